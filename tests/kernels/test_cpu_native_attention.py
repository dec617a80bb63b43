"""The native CPU decode kernel (csrc/cpu/paged_attention.cpp) vs the torch reference, its
oracle: decode batches with shuffled block ids and noise in unused blocks, lengths of 1 and
exact multiples of the block size, GQA ratios 1-4, head sizes 16/64/128, block sizes 8/16,
fp32 (tight) and bf16/fp16 (loose, against fp32 on the same rounded inputs); mixed batches
through the backend; and greedy generation equal to VLLM_USE_TORCH_REFERENCE_OPS=1.

Every test skips, with the build error as its reason, where the kernel cannot be built."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention import MIXED, make_batch, reference
from vllm import LLM, SamplingParams
from vllm.attention.backends import cpu_native, torch_ref
from vllm.attention.layer import Attention


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    reason = cpu_native.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native CPU attention kernel cannot be built here: {reason}")


def decode_specs(lengths):
    """(context_len, query_len) for decodes of the given KV lengths."""
    return [(n - 1, 1) for n in lengths]


def run_native(query, cache, meta, scale):
    out = torch.full_like(query[: meta.num_decodes], float("nan"))
    cpu_native.paged_decode_attention(out, query, cache, meta.block_table, meta.seq_lens, scale)
    return out


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_size", [16, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2)], ids=["g1", "g2", "g3", "g4"])
def test_decode_matches_reference(num_heads, num_kv_heads, head_size, block_size):
    lengths = [1, block_size, 2 * block_size, 3 * block_size + 1, 37, 100, block_size - 1]
    query, key, value, cache, meta = make_batch(decode_specs(lengths), num_heads, num_kv_heads, head_size, block_size,
                                                seed=head_size + block_size)
    scale = head_size**-0.5
    ref, cache = reference(query, key, value, cache, meta, scale)
    torch.testing.assert_close(run_native(query, cache, meta, scale), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_fp32(dtype):
    """Oracle: fp32 attention over the same rounded inputs; the only error allowed is the
    final rounding of the output (and fp32 summation order)."""
    query, key, value, cache, meta = make_batch(decode_specs([1, 16, 33, 250, 300]), 9, 3, 64, 16, dtype=dtype, seed=5)
    scale = 0.125
    ref, _ = reference(query.float(), key.float(), value.float(), cache.float(), meta, scale)
    torch_ref.store_kv(key, value, cache, meta.slot_mapping)
    out = run_native(query, cache, meta, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_mixed_batch_through_backend():
    """Decodes run natively, prefills (fresh and on a cached prefix) run torch_ref."""
    query, key, value, cache, meta = make_batch(MIXED, 8, 2, 64, 16, seed=7)
    ref, cache = reference(query, key, value, cache, meta, 0.125)
    n = meta.num_actual_tokens
    out = cpu_native.paged_attention(query[:n], key[:n], value[:n], cache, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    d = meta.num_decodes
    assert torch.equal(out[d:], ref[d:])


def test_strided_query_and_output_views():
    """The layer hands in views of a fused qkv projection (token stride > H * D); out rows
    may be a slice of a larger buffer."""
    query, key, value, cache, meta = make_batch(decode_specs([5, 40, 17]), 4, 2, 32, 16, seed=3)
    ref, cache = reference(query, key, value, cache, meta, 0.25)
    n = meta.num_actual_tokens
    qkv = torch.cat([query.reshape(n, -1), key.reshape(n, -1), value.reshape(n, -1)], dim=1)
    q = qkv[:, : 4 * 32].view(n, 4, 32)
    buffer = torch.zeros(n, 4, 48)
    cpu_native.paged_decode_attention(buffer[:, :, 8:40], q, cache, meta.block_table, meta.seq_lens, 0.25)
    torch.testing.assert_close(buffer[:, :, 8:40], ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(buffer[:, :, :8]) == 0 and torch.count_nonzero(buffer[:, :, 40:]) == 0


def test_thread_count_does_not_change_results():
    """Each (sequence, KV head) task is computed whole by one thread: results are bitwise
    independent of torch.set_num_threads."""
    query, key, value, cache, meta = make_batch(decode_specs([3, 70, 129, 64, 200, 1]), 6, 3, 64, 16, seed=11)
    _, cache = reference(query, key, value, cache, meta, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_native(query, cache, meta, 0.125)
        torch.set_num_threads(max(2, threads))
        multi = run_native(query, cache, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)


def test_rejects_lengths_and_blocks_outside_the_cache():
    query, key, value, cache, meta = make_batch(decode_specs([10, 20]), 4, 2, 16, 8, seed=2)
    too_long = meta.seq_lens.clone()
    too_long[1] = meta.block_table.shape[1] * 8 + 1
    with pytest.raises(RuntimeError, match="seq_lens"):
        cpu_native.paged_decode_attention(torch.empty(2, 4, 16), query, cache, meta.block_table, too_long, 0.25)
    bad_table = meta.block_table.clone()
    bad_table[0, 1] = cache.shape[1]
    with pytest.raises(RuntimeError, match="block_table"):
        cpu_native.paged_decode_attention(torch.empty(2, 4, 16), query, cache, bad_table, meta.seq_lens, 0.25)


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


def _attention_ops(llm):
    return {m._attend for m in llm.llm_engine.engine_core.runner.model.modules() if isinstance(m, Attention)}


def test_engine_greedy_matches_reference_ops(llama_dir, tokenizer, monkeypatch):
    """Block size 8 with prompts of 1-70 tokens: decodes cross block boundaries while
    prompts are still prefilling in the same steps."""
    text = "one two three four five six seven eight nine ten eleven twelve " * 6
    ids = tokenizer.encode(text)
    prompts = [ids[:1], ids[:8], ids[:16], ids[:23], ids[:70], tokenizer.encode("What is the capital of France?")]
    native = LLM(llama_dir, max_model_len=128, block_size=8, max_num_batched_tokens=48)
    assert _attention_ops(native) == {cpu_native.paged_attention}
    got = _greedy(native, prompts)
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    reference_llm = LLM(llama_dir, max_model_len=128, block_size=8, max_num_batched_tokens=48)
    assert _attention_ops(reference_llm) == {torch_ref.paged_attention}
    expected = _greedy(reference_llm, prompts)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
