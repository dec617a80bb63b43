"""--kv-cache-dtype: a bf16 KV cache under a float32 model. The oracle is transformers (and PEFT
for aLoRA) with a cache that stores keys and values rounded to bf16 (tests/utils/reference.py's
RoundedCache): greedy tokens identical, the cache's bf16 keys and values the oracle's but for
rounding-boundary flips, logprobs within 1e-4 where there are none, through the native CPU kernels
and through the torch reference ops, for a fresh prompt, decodes, chunked prefill and an aLoRA reusing
the base model's cached conversation. Also the option's parsing and refusals, the cache's dtype
and size, and that a prompt's output does not depend on whether its prefix came from the cache."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import INVOCATION
from tests.utils.adapters import load_peft_model
from tests.utils.checkpoints import load_hf_model
from tests.utils.reference import RoundedCache, hf_greedy
from vllm import LLM, EngineArgs, SamplingParams
from vllm.config import CacheConfig
from vllm.lora.request import LoRARequest
from vllm.worker.kv_cache import bytes_per_block

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def _greedy(llm, ids, lora_request=None):
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, lora_request=lora_request, use_tqdm=False)[0]
    completion = out.outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    return completion.token_ids, logprobs, out.num_cached_tokens


# Logprob tolerances against the oracle. Where the engine's cache holds exactly the oracle's bf16
# keys and values, logprobs agree as closely as with an fp32 cache. But neither the native CPU
# linears nor the torch reference ops are bitwise transformers' (they agree to ~1e-6 relative): a
# key or value whose fp32 value lies that close to the midpoint between two bf16 numbers is stored
# as the neighbouring one (one bf16 step, 0.4%), which moves this tiny random model's logprobs by
# up to ~1.5e-3 (measured: a layer-1 key 15 fp32 ulps from the midpoint, 1.6e-4). Such flips are
# told apart from wrong values in the cache itself (_flips_in_cache); the kernels match the
# rounded reference to 1e-6 (tests/kernels/test_cpu_native_attention.py).
TOLERANCE = {"same_cache": 1e-4, "flipped": 5e-3}
# A value rounds either way when it lies this close (relative) to a bf16 rounding boundary; one
# drawn at random lies ~1e-3 from the nearest.
MIDPOINT_RTOL = 1e-4


def _check(got, expected, tolerance=TOLERANCE["same_cache"]):
    tokens, logprobs, _ = got
    ref_tokens, ref_logprobs = expected
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < tolerance


def _conversation(tokenizer, n_tokens):
    return tokenizer.encode("The quick brown fox jumps over the lazy dog. What is the capital of France? " * 20)[:n_tokens]


def test_option_parses_and_refuses_what_it_cannot_serve(llama_dir):
    config = EngineArgs(model=llama_dir, dtype="float32", kv_cache_dtype="bfloat16").create_engine_config()
    assert config.cache_config.cache_dtype == torch.bfloat16
    assert config.cache_config.kv_dtype(config.model_config.dtype) == torch.bfloat16
    auto = EngineArgs(model=llama_dir, dtype="float32").create_engine_config().cache_config
    assert auto.cache_dtype is None and auto.kv_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'fp8' is not supported; supported: auto .* or bfloat16"):
        EngineArgs(model=llama_dir, kv_cache_dtype="fp8").create_engine_config()
    with pytest.raises(ValueError, match=r"needs a float32 or bfloat16 model; this one runs float16"):
        EngineArgs(model=llama_dir, dtype="float16", kv_cache_dtype="bfloat16").create_engine_config()


def test_an_fp32_models_bf16_cache_is_refused_on_cuda():
    """The Triton kernels read the cache in the query's dtype: on CUDA only a bf16 model's cache is bf16."""
    from types import SimpleNamespace

    cuda = SimpleNamespace(is_cuda=True)
    args = EngineArgs(model="unused", kv_cache_dtype="bfloat16")
    assert args._kv_cache_dtype(torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match=r"under a float32 model runs on the CPU backend only"):
        args._kv_cache_dtype(torch.float32, cuda)


def test_cli_flag_reaches_the_config(llama_dir):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-cache-dtype", "bfloat16"])
    engine_args = EngineArgs.from_cli_args(argparse.Namespace(**vars(args), model=llama_dir))
    assert engine_args.kv_cache_dtype == "bfloat16"


def test_a_bf16_block_takes_half_the_bytes(llama_dir):
    model_config = EngineArgs(model=llama_dir, dtype="float32").create_engine_config().model_config
    fp32 = bytes_per_block(model_config, CacheConfig(block_size=16))
    assert bytes_per_block(model_config, CacheConfig(block_size=16, cache_dtype=torch.bfloat16)) * 2 == fp32


def _record_freed_blocks(llm, monkeypatch) -> dict[str, list[int]]:
    """Each finished request's block ids, recorded as the KV-cache manager frees them."""
    manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    freed: dict[str, list[int]] = {}
    free = manager.free

    def recording_free(request):
        freed[request.request_id] = manager.get_block_ids(request.request_id)
        free(request)

    monkeypatch.setattr(manager, "free", recording_free)
    return freed


def _flips_in_cache(llm, block_ids: list[int], oracle: RoundedCache, num_tokens: int) -> bool:
    """Whether the request's bf16 cache differs from the oracle's at all. Its first difference in
    causal order (earliest token, then lowest layer) must be rounding-boundary flips: each element
    the oracle's neighbouring bf16 value, the oracle's unrounded value within MIDPOINT_RTOL of the
    midpoint between the two. Later differences follow from that one, so they may be anything."""
    caches = llm.llm_engine.engine_core.runner.kv_caches
    # each cache: [2 (keys, values), num_blocks, block_size, num_kv_heads, head_dim]
    got = torch.stack([c[:, block_ids].flatten(1, 2)[:, :num_tokens] for c in caches])
    # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
    raw = torch.stack([oracle.unrounded[i][:, 0].transpose(1, 2) for i in range(len(caches))])
    want = raw.to(torch.bfloat16)
    differ = got != want
    if not differ.any():
        return False
    token = int(differ.any(dim=(0, 1, 3, 4)).nonzero()[0])
    layer = int(differ[:, :, token].any(dim=(1, 2, 3)).nonzero()[0])
    first = differ[layer, :, token]
    got, want, raw = got[layer, :, token][first], want[layer, :, token][first], raw[layer, :, token][first]
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert (steps == 1).all(), f"token {token}, layer {layer}: up to {int(steps.max())} bf16 steps from the oracle"
    midpoint = (got.float() + want.float()) / 2
    off = ((raw - midpoint).abs() / midpoint.abs()).max().item()
    assert off <= MIDPOINT_RTOL, f"token {token}, layer {layer}: {off:.1e} (relative) from a rounding boundary"
    return True


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return load_hf_model(llama_dir)


@pytest.mark.parametrize("ops", ["native", "reference"])
def test_greedy_matches_transformers_with_a_bf16_rounded_cache(ops, llama_dir, tokenizer, hf_model, monkeypatch):
    """Block size 8 and a 24-token step budget: the 40-token prompt is chunked, its later chunks
    reading the earlier ones from the cache, and decodes cross blocks."""
    if ops == "reference":
        monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    llm = LLM(llama_dir, dtype="float32", kv_cache_dtype="bfloat16", max_model_len=128, block_size=8,
              max_num_batched_tokens=24)
    caches = llm.llm_engine.engine_core.runner.kv_caches
    assert caches and all(c.dtype == torch.bfloat16 for c in caches)
    freed = _record_freed_blocks(llm, monkeypatch)
    for ids in (tokenizer.encode("What is the capital of France?"), _conversation(tokenizer, 40)):
        oracle = RoundedCache(torch.bfloat16)
        expected = hf_greedy(hf_model, ids, MAX_NEW, cache=oracle)
        got = _greedy(llm, ids)
        (block_ids,) = freed.values()
        freed.clear()
        flipped = _flips_in_cache(llm, block_ids, oracle, len(ids) + MAX_NEW - 1)
        _check(got, expected, TOLERANCE["flipped" if flipped else "same_cache"])
        # The oracle tells the two caches apart: rounding the keys and values moves the logprobs.
        fp32_logprobs = hf_greedy(hf_model, ids, MAX_NEW)[1]
        assert max(abs(a - b) for a, b in zip(fp32_logprobs, expected[1])) > TOLERANCE["same_cache"]


def test_a_cached_prefix_gives_the_same_output_as_a_fresh_prompt(llama_dir, tokenizer):
    """The prompt's own keys are rounded as the cache rounds them, so a prefix-cache hit (keys read
    back from bf16) and a fresh prefill (keys of this step) agree."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_dtype="bfloat16", max_model_len=128, block_size=8)
    conv = _conversation(tokenizer, 48)
    fresh = _greedy(llm, conv + tokenizer.encode(" Paris"))
    assert fresh[2] == 0
    again = _greedy(llm, conv + tokenizer.encode(" Paris"))
    assert again[2] >= 40
    _check(again, fresh[:2])


def test_alora_over_the_cached_base_conversation_matches_peft(llama_dir, adapters, tokenizer):
    """The headline path with a bf16 cache: the base turn fills the cache, the aLoRA request reuses
    it (base-KV reuse) and equals PEFT over bf16-rounded keys and values."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_dtype="bfloat16", max_model_len=256, block_size=8,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    conv = _conversation(tokenizer, 40)
    _greedy(llm, conv)
    ids = conv + tokenizer.encode(INVOCATION)
    got = _greedy(llm, ids, LoRARequest("certainty", 1, adapters["alora_certainty"]))
    assert got[2] >= 32  # the conversation's whole blocks came from the base turn
    peft = load_peft_model(llama_dir, adapters["alora_certainty"])
    _check(got, hf_greedy(peft, ids, MAX_NEW, kv_cache_dtype=torch.bfloat16), TOLERANCE["flipped"])
