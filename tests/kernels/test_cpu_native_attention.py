"""The native CPU attention kernel (vllm/csrc/cpu/paged_attention.cpp) vs the torch reference, its
oracle: decodes and short prefills on a cached prefix (an aLoRA's few tokens over a long
conversation) with shuffled block ids and noise in unused blocks, lengths of 1 and exact
multiples of the block size, query runs and long contexts split across tasks (and merged),
GQA ratios 1-4, head sizes 16/32/40/64/96/128, block sizes 5/8/12/16/80, fp32 (tight) and bf16/fp16
(loose, against fp32 on the same rounded inputs; bf16 prompts through the AVX512-BF16 tiles too; bf16
decodes through them too, within the probabilities' and output's rounding), fp32
queries over a bf16 cache (tight, against fp32 on the rounded cache); sequences above max_query_len left alone;
results bitwise independent of threads (a lone decode's KV heads shared out among threads too)
and of the rest of the batch; mixed batches through
the backend; and greedy generation equal to VLLM_USE_TORCH_REFERENCE_OPS=1.

Attention variants (sliding window, soft cap, sinks): every variant of
test_attention_variants.variants() against its float64 dense_reference in fp32 (and against
torch_ref in bf16), over the mixed batch, short runs and long contexts; a window far shorter
than the context reads only the window's blocks (the others hold NaN); a window wider than
the context is bitwise the plain kernel.

Every test skips, with the build error as its reason, where the kernel cannot be built."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention import MIXED, make_batch, reference
from tests.kernels.test_attention_variants import dense_reference, variants
from vllm import LLM, SamplingParams
from vllm.attention.backends import cpu_native, torch_ref
from vllm.attention.layer import Attention
from vllm.attention.variant import PLAIN, AttentionVariant


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    reason = cpu_native.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native CPU attention kernel cannot be built here: {reason}")


def decode_specs(lengths):
    """(context_len, query_len) for decodes of the given KV lengths."""
    return [(n - 1, 1) for n in lengths]


def run_native(query, cache, meta, scale, max_query_len=cpu_native.MAX_QUERY_LEN, fill=float("nan"),
               variant=PLAIN):
    out = torch.full_like(query[: meta.num_actual_tokens], fill)
    cpu_native.paged_attention_rows(out, query, cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                    max_query_len, scale, variant)
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


# (context_len, query_len): decodes first, then fresh prompts, runs of 2-3 tokens (dot products
# on the keys in place), runs long enough to transpose key chunks, runs split over several tasks
# (> 32 tokens), and query ends on and just past block boundaries.
SHORT = [(0, 1), (40, 1), (0, 2), (7, 3), (0, 9), (37, 20), (5, 70), (16, 16), (63, 17), (300, 33), (1, 40),
         (90, 100)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(4, 4, 16, 16), (4, 2, 64, 16), (8, 2, 16, 8), (6, 2, 40, 12), (8, 2, 128, 16), (9, 3, 64, 16), (3, 1, 64, 8),
     (4, 2, 32, 80)],  # a block longer than the kernel's 64-key chunks
)
def test_short_prefills_on_a_cached_prefix_match_reference(num_heads, num_kv_heads, head_size, block_size):
    query, key, value, cache, meta = make_batch(SHORT, num_heads, num_kv_heads, head_size, block_size,
                                                seed=head_size + num_heads)
    scale = head_size**-0.5
    ref, cache = reference(query, key, value, cache, meta, scale)
    torch.testing.assert_close(run_native(query, cache, meta, scale), ref, atol=2e-5, rtol=2e-5)


# Contexts over several key ranges (kKeysPerTask = 512 keys, rounded up to whole blocks): decodes
# on both sides of a range boundary, and runs whose first tokens attend to none of the last
# range's keys (their partial there is empty) while the run's last token does.
LONG = [(511, 1), (512, 1), (1100, 1), (2047, 1), (505, 20), (1020, 9), (600, 40), (1536, 3)]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(16, 9, 3), (12, 4, 2), (8, 8, 8)])
def test_long_contexts_merge_key_ranges_like_one_softmax(block_size, num_heads, num_kv_heads):
    query, key, value, cache, meta = make_batch(LONG, num_heads, num_kv_heads, 64, block_size, seed=block_size)
    ref, cache = reference(query, key, value, cache, meta, 0.125)
    torch.testing.assert_close(run_native(query, cache, meta, 0.125), ref, atol=2e-5, rtol=2e-5)


# Long prompts, which the kernel takes whole: whole prompts and chunks over a cached prefix, with
# a decode beside them.
LONG_PROMPTS = [(0, 1030), (700, 600), (900, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompts_match_reference(dtype):
    query, key, value, cache, meta = make_batch(LONG_PROMPTS, 9, 3, 64, 16, seed=9)
    query, key, value, cache = (t.to(dtype) for t in (query, key, value, cache))
    ref, cache = reference(query, key, value, cache, meta, 0.125)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(run_native(query, cache, meta, 0.125, max_query_len=2048), ref, **tol)


def test_the_kernel_takes_prompts_of_every_length():
    """The kernel is at or ahead of SDPA at every measured length, AVX2 and AVX-512 alike."""
    assert cpu_native.MAX_QUERY_LEN == 2**31 - 1


def test_sequences_above_max_query_len_are_not_written():
    query, key, value, cache, meta = make_batch(SHORT, 8, 2, 64, 16, seed=4)
    ref, cache = reference(query, key, value, cache, meta, 0.125)
    out = run_native(query, cache, meta, 0.125, max_query_len=16, fill=7.0)
    qsl = meta.query_start_loc_cpu.tolist()
    for i, (_, q_len) in enumerate(SHORT):
        rows = slice(qsl[i], qsl[i + 1])
        if q_len <= 16:
            torch.testing.assert_close(out[rows], ref[rows], atol=2e-5, rtol=2e-5)
        else:
            assert torch.all(out[rows] == 7.0), f"sequence {i} ({q_len} tokens) was written"


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(9, 3, 64, 16), (8, 2, 128, 16), (4, 2, 32, 80), (4, 2, 64, 5), (6, 2, 40, 12), (3, 1, 96, 8)],
    ids=["h64", "h128", "block80", "block5", "h40", "h96"],
)
def test_bf16_prompts_match_fp32_on_the_same_inputs(num_heads, num_kv_heads, head_size, block_size):
    """Prompts and chunks in bf16 (on AVX512-BF16 CPUs the bf16 dot-product tiles where the head
    size is a multiple of 32: odd blocks, whose key pairs straddle two blocks, and odd chunk
    ends; the fp32 tiles for head size 40) against fp32 attention over the same rounded inputs:
    the probabilities' bf16 rounding and the output's are all the error allowed."""
    query, key, value, cache, meta = make_batch(SHORT, num_heads, num_kv_heads, head_size, block_size,
                                                dtype=torch.bfloat16, seed=head_size + block_size)
    scale = head_size**-0.5
    ref, _ = reference(query.float(), key.float(), value.float(), cache.float(), meta, scale)
    torch_ref.store_kv(key, value, cache, meta.slot_mapping)
    torch.testing.assert_close(run_native(query, cache, meta, scale).float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size",
    [(4, 4, 64), (4, 2, 32), (9, 3, 64), (8, 2, 128), (7, 1, 64), (6, 2, 40)],
    ids=["g1", "g2", "g3", "g4", "g7", "h40"],
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_bf16_decodes_round_only_probabilities_and_output(num_heads, num_kv_heads, head_size, block_size):
    """bf16 decodes (on AVX512-BF16 CPUs, where the head size is a multiple of 32, the logits by bf16
    dot products on the keys in place, four keys at a time and the rest one by one, and the value
    sums by dot products over interleaved pairs of value rows, an odd last one alone; tiles of 1-4
    rows, 7 = 4 + 3; odd blocks, whose last value row pairs with zeros; contexts over 512 keys split
    and merged) against fp32 attention over the same
    rounded inputs. The logits' products are exact and summed in fp32; the probabilities are rounded
    to bf16 (as the prompt tiles and SDPA do) and the output once more: each within half a unit in
    its last place (2^-8 of it), so out may differ from fp32 by 2^-8 (sum_t p_t |v_t| + |out|).
    Elsewhere (head size 40, other CPUs) the arithmetic is fp32 and the bound holds too."""
    specs = decode_specs([1, 2, 3, 5, 16, 17, 37, 600, 1100])
    query, key, value, cache, meta = make_batch(specs, num_heads, num_kv_heads, head_size, block_size,
                                                dtype=torch.bfloat16, seed=head_size + num_heads + block_size)
    scale = head_size**-0.5
    ref, _ = reference(query.float(), key.float(), value.float(), cache.float(), meta, scale)
    abs_cache = cache.float()
    abs_cache[1].abs_()
    ref_abs, _ = reference(query.float(), key.float(), value.float().abs(), abs_cache, meta, scale)
    torch_ref.store_kv(key, value, cache, meta.slot_mapping)
    error = (run_native(query, cache, meta, scale).float() - ref).abs()
    bound = 2**-8 * (ref_abs + ref.abs()) * 1.01 + 1e-6
    assert torch.all(error <= bound), f"worst excess {(error - bound).max().item():.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_fp32(dtype):
    """Oracle: fp32 attention over the same rounded inputs; the only error allowed is the
    final rounding of the output (and fp32 summation order)."""
    specs = decode_specs([1, 16, 33, 250, 300]) + [(120, 5), (64, 24)]
    query, key, value, cache, meta = make_batch(specs, 9, 3, 64, 16, dtype=dtype, seed=5)
    scale = 0.125
    ref, _ = reference(query.float(), key.float(), value.float(), cache.float(), meta, scale)
    torch_ref.store_kv(key, value, cache, meta.slot_mapping)
    out = run_native(query, cache, meta, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("specs", [decode_specs([1, 16, 33, 250, 700]), SHORT, MIXED], ids=["decodes", "short", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (6, 2, 40)])
def test_fp32_queries_over_a_bf16_cache_match_fp32_on_the_rounded_cache(specs, num_heads, num_kv_heads, head_size,
                                                                        monkeypatch):
    """--kv-cache-dtype bfloat16 under an fp32 model: the kernel widens each bf16 key and value
    exactly as it reads it, so against fp32 attention over the rounded keys and values only the
    summation order differs (fp32 tolerance); through the backend with MAX_QUERY_LEN lowered to 8,
    the longer prompts (torch_ref) see their keys rounded the same way."""
    query, key, value, cache, meta = make_batch(specs, num_heads, num_kv_heads, head_size, 16, seed=head_size)
    n, scale = meta.num_actual_tokens, head_size**-0.5
    rounded = key.bfloat16().float(), value.bfloat16().float()
    ref, _ = reference(query, *rounded, cache.bfloat16().float(), meta, scale)
    stored = cache.bfloat16()
    torch_ref.store_kv(key[:n], value[:n], stored, meta.slot_mapping[:n])
    out = run_native(query, stored, meta, scale, max_query_len=10**6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(cpu_native, "MAX_QUERY_LEN", 8)
    torch.testing.assert_close(cpu_native.paged_attention(query[:n], key[:n], value[:n], stored, meta, scale), ref,
                               atol=1e-5, rtol=1e-5)


def test_a_bf16_cache_takes_only_fp32_queries():
    query, _, _, cache, meta = make_batch(decode_specs([10, 20]), 4, 2, 16, 8, seed=27)
    with pytest.raises(RuntimeError, match=r"or be bf16 under fp32"):
        run_native(query.half(), cache.bfloat16(), meta, 0.25)


def test_mixed_batch_through_backend():
    """Decodes and short prefills run natively, longer prefills run torch_ref."""
    query, key, value, cache, meta = make_batch(MIXED, 8, 2, 64, 16, seed=7)
    ref, cache = reference(query, key, value, cache, meta, 0.125)
    n = meta.num_actual_tokens
    out = cpu_native.paged_attention(query[:n], key[:n], value[:n], cache, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_long_prefills_still_run_the_reference(monkeypatch):
    """With MAX_QUERY_LEN below a sequence's query length, that sequence's rows are torch_ref's
    exactly (the same ops on the same inputs)."""
    monkeypatch.setattr(cpu_native, "MAX_QUERY_LEN", 8)
    query, key, value, cache, meta = make_batch(MIXED, 8, 2, 64, 16, seed=8)
    ref, cache = reference(query, key, value, cache, meta, 0.125)
    n = meta.num_actual_tokens
    out = cpu_native.paged_attention(query[:n], key[:n], value[:n], cache, meta, 0.125)
    qsl = meta.query_start_loc_cpu.tolist()
    for i, (_, q_len) in enumerate(MIXED):
        rows = slice(qsl[i], qsl[i + 1])
        if q_len > 8:
            assert torch.equal(out[rows], ref[rows])
        else:
            torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)


def test_strided_query_and_output_views():
    """The layer hands in views of a fused qkv projection (token stride > H * D); out rows
    may be a slice of a larger buffer."""
    query, key, value, cache, meta = make_batch(decode_specs([5, 40, 17]) + [(30, 6)], 4, 2, 32, 16, seed=3)
    ref, cache = reference(query, key, value, cache, meta, 0.25)
    n = meta.num_actual_tokens
    qkv = torch.cat([query.reshape(n, -1), key.reshape(n, -1), value.reshape(n, -1)], dim=1)
    q = qkv[:, : 4 * 32].view(n, 4, 32)
    buffer = torch.zeros(n, 4, 48)
    cpu_native.paged_attention_rows(buffer[:, :, 8:40], q, cache, meta.block_table, meta.seq_lens,
                                    meta.query_start_loc, 64, 0.25)
    torch.testing.assert_close(buffer[:, :, 8:40], ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(buffer[:, :, :8]) == 0 and torch.count_nonzero(buffer[:, :, 40:]) == 0


def test_thread_count_does_not_change_results():
    """Tasks are split by each sequence's own lengths, never by the thread count: results are
    bitwise independent of torch.set_num_threads. (33 groups of a run and a KV head: one to three
    threads run whole groups, five run the tasks and then the merges.)"""
    specs = decode_specs([3, 70, 129, 64, 200, 1, 1300]) + [(300, 20), (17, 33), (700, 18)]
    query, key, value, cache, meta = make_batch(specs, 6, 3, 64, 16, seed=11)
    _, cache = reference(query, key, value, cache, meta, 0.125)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            results.append(run_native(query, cache, meta, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("lengths", [[300], [1100], [40, 1300]], ids=["one", "one-of-four-ranges", "two"])
def test_decodes_on_more_threads_than_key_ranges_share_out_their_heads(lengths):
    """A decode task reads the blocks of all its KV heads in turn; where that leaves threads idle
    (one or two decodes on more threads than their key ranges), the heads are shared out among
    tasks instead. Which heads share a task changes no row: every thread count gives the same
    bits, matching the reference."""
    query, key, value, cache, meta = make_batch(decode_specs(lengths), 16, 8, 64, 16, seed=13)
    ref, cache = reference(query, key, value, cache, meta, 0.125)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 5, 8):
            torch.set_num_threads(n)
            results.append(run_native(query, cache, meta, 0.125))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0], ref, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch():
    """The work split follows each sequence's own lengths, so the rest of the batch never
    changes a row (the aLoRA tests compare batched requests with solo runs)."""
    specs = [(1300, 1), (40, 1), (700, 18), (5, 3)]
    query, key, value, cache, meta = make_batch(specs, 6, 3, 64, 16, seed=12)
    _, cache = reference(query, key, value, cache, meta, 0.125)
    batched = run_native(query, cache, meta, 0.125)
    qsl = meta.query_start_loc_cpu.tolist()
    for i in range(len(specs)):
        rows = slice(qsl[i], qsl[i + 1])
        alone = torch.full_like(query[rows], float("nan"))
        cpu_native.paged_attention_rows(alone, query[rows], cache, meta.block_table[i : i + 1], meta.seq_lens[i : i + 1],
                                        torch.tensor([0, qsl[i + 1] - qsl[i]], dtype=torch.int32), 512, 0.125)
        assert torch.equal(alone, batched[rows]), f"sequence {i} differs alone"


def test_rejects_lengths_ranges_and_blocks_outside_the_cache():
    query, key, value, cache, meta = make_batch(decode_specs([10, 20]) + [(5, 3)], 4, 2, 16, 8, seed=2)
    out = torch.empty(5, 4, 16)

    def call(seq_lens=meta.seq_lens, block_table=meta.block_table, qsl=meta.query_start_loc):
        cpu_native.paged_attention_rows(out, query, cache, block_table, seq_lens, qsl, 64, 0.25)

    too_long = meta.seq_lens.clone()
    too_long[1] = meta.block_table.shape[1] * 8 + 1
    with pytest.raises(RuntimeError, match="seq_lens"):
        call(seq_lens=too_long)
    shorter_than_query = meta.seq_lens.clone()
    shorter_than_query[2] = 2  # three query tokens cannot sit in a sequence of two
    with pytest.raises(RuntimeError, match="seq_lens"):
        call(seq_lens=shorter_than_query)
    bad_table = meta.block_table.clone()
    bad_table[0, 1] = cache.shape[1]
    with pytest.raises(RuntimeError, match="block_table"):
        call(block_table=bad_table)
    past_the_query = meta.query_start_loc.clone()
    past_the_query[-1] = query.shape[0] + 1
    with pytest.raises(RuntimeError, match="query_start_loc"):
        call(qsl=past_the_query)


def cached(query, key, value, cache, meta):
    """The cache with this step's keys and values stored, as the engine has it before attention."""
    n = meta.num_actual_tokens
    cache = cache.clone()
    torch_ref.store_kv(key[:n], value[:n], cache, meta.slot_mapping[:n])
    return cache


# Batches for the variants: the mixed batch of test_attention (decodes, fresh prompts, a chunk on a
# prefix, shuffled blocks), short runs split over several tasks, and contexts over several key ranges.
VARIANT_BATCHES = {"mixed": (MIXED, 4, 2, 16, 8), "mixed_mha": (MIXED, 6, 6, 8, 16), "short": (SHORT, 8, 2, 64, 16),
                   "long": (LONG, 9, 3, 64, 16)}


@pytest.mark.parametrize("batch", list(VARIANT_BATCHES))
@pytest.mark.parametrize("name", list(variants(1)))
def test_variants_match_dense_reference(name, batch):
    specs, num_heads, num_kv_heads, head_size, block_size = VARIANT_BATCHES[batch]
    variant = variants(num_heads)[name]
    query, key, value, cache, meta = make_batch(specs, num_heads, num_kv_heads, head_size, block_size, seed=21)
    cache, scale = cached(query, key, value, cache, meta), head_size**-0.5
    expected = dense_reference(query, cache, meta, scale, variant)
    out = run_native(query, cache, meta, scale, variant=variant)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)
    # The backend runs the same rows natively (all of these batches' query runs are <= 512 tokens).
    n = meta.num_actual_tokens
    backend = cpu_native.paged_attention(query[:n], key[:n], value[:n], cache, meta, scale, variant)
    assert torch.equal(backend, out)


@pytest.mark.parametrize("name", list(variants(1)))
def test_variants_in_bf16_match_torch_ref(name):
    """bf16 storage, fp32 arithmetic; torch_ref's own bf16 rounding differs (SDPA or bf16
    probabilities times bf16 values), hence the loose tolerance."""
    variant = variants(8)[name]
    query, key, value, cache, meta = make_batch(MIXED, 8, 2, 64, 16, dtype=torch.bfloat16, seed=22)
    cache, n = cached(query, key, value, cache, meta), meta.num_actual_tokens
    expected = torch_ref.paged_attention(query[:n], key[:n], value[:n], cache, meta, 0.125, variant)
    out = run_native(query, cache, meta, 0.125, variant=variant)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("variant", [AttentionVariant(sliding_window=40),
                                     AttentionVariant(sliding_window=100, soft_cap=5.0, sinks=torch.ones(6))],
                         ids=["window", "window_cap_sinks"])
def test_window_far_shorter_than_the_context_reads_only_its_blocks(variant):
    """Contexts of 1-3k tokens under a window of 40 or 100: decodes, and runs whose tokens'
    windows start in different blocks. Every block wholly before the first query token's
    window holds NaN afterwards; a kernel that read one would return NaN."""
    specs = [(3000, 1), (1234, 1), (2047, 1), (1500, 20), (2100, 37), (900, 3)]
    query, key, value, cache, meta = make_batch(specs, 6, 2, 64, 16, seed=23)
    cache = cached(query, key, value, cache, meta)
    expected = dense_reference(query, cache, meta, 0.125, variant)
    window = variant.sliding_window
    for i, (context, _) in enumerate(specs):
        first_block = max(0, context - window + 1) // 16
        cache[:, meta.block_table[i, :first_block].long()] = float("nan")
    out = run_native(query, cache, meta, 0.125, variant=variant)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_window_wider_than_the_context_is_bitwise_plain():
    query, key, value, cache, meta = make_batch(SHORT + LONG, 8, 2, 64, 16, seed=24)
    cache = cached(query, key, value, cache, meta)
    plain = run_native(query, cache, meta, 0.125)
    assert torch.equal(run_native(query, cache, meta, 0.125, variant=AttentionVariant(sliding_window=2048)), plain)


def test_variant_rows_are_bitwise_the_same_alone_and_for_any_thread_count():
    variant = variants(6)["all"]
    specs = [(1300, 1), (40, 1), (700, 18), (5, 3)]
    query, key, value, cache, meta = make_batch(specs, 6, 3, 64, 16, seed=25)
    cache = cached(query, key, value, cache, meta)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(run_native(query, cache, meta, 0.125, variant=variant))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    qsl = meta.query_start_loc_cpu.tolist()
    for i in range(len(specs)):
        rows = slice(qsl[i], qsl[i + 1])
        alone = torch.full_like(query[rows], float("nan"))
        alone_qsl = torch.tensor([0, qsl[i + 1] - qsl[i]], dtype=torch.int32)
        cpu_native.paged_attention_rows(alone, query[rows], cache, meta.block_table[i : i + 1],
                                        meta.seq_lens[i : i + 1], alone_qsl, 512, 0.125, variant)
        assert torch.equal(alone, results[0][rows]), f"sequence {i} differs alone"


def test_rejects_sinks_of_the_wrong_shape():
    query, key, value, cache, meta = make_batch(decode_specs([10, 20]), 4, 2, 16, 8, seed=26)
    with pytest.raises(RuntimeError, match=r"sinks must be a floating CPU tensor of shape \[num_heads\] = \[4\]"):
        run_native(query, cache, meta, 0.25, variant=AttentionVariant(sinks=torch.zeros(2)))


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
