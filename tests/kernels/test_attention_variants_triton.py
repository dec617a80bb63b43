"""Attention variants (sliding window, logit soft cap, sinks) in the Triton paged attention
kernels (run by the Triton interpreter on CPU): fp32 against the float64 dense oracle of
tests/kernels/test_attention_variants.py, fp16 against the torch reference. Covers the
split-K decode and its reduce, prefill query tiles that cross the window's edge, GQA,
padded head sizes, CUDA-graph padding rows, and that KV tiles before the window are
never read.

bf16 is not run here: the interpreter runs tl.dot on bf16's raw bits (numpy has no bf16);
benchmarks/triton_aot.py compiles the bf16 specializations for sm_80 and sm_90.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention import MIXED, make_batch
from tests.kernels.test_attention_variants import dense_reference, variants
from vllm.attention.backends import torch_ref, triton_backend
from vllm.attention.ops.paged_attention import paged_decode, paged_prefill
from vllm.attention.variant import AttentionVariant

FP32_TOL = dict(atol=2e-5, rtol=0)


def _filled_batch(specs, num_heads, num_kv_heads, head_size, block_size, **kwargs):
    """make_batch with this step's keys and values already in the cache."""
    query, key, value, cache, meta = make_batch(specs, num_heads, num_kv_heads, head_size, block_size, **kwargs)
    n = meta.num_actual_tokens
    torch_ref.store_kv(key[:n], value[:n], cache, meta.slot_mapping[:n])
    return query, key, value, cache, meta


@pytest.mark.parametrize("name", list(variants(1)))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size", [(4, 2, 16, 8), (6, 3, 40, 16)],
                         ids=["gqa-d16-b8", "gqa-d40-b16"])
def test_mixed_batch_matches_dense_reference(name, num_heads, num_kv_heads, head_size, block_size):
    """Decodes, fresh prefills and chunks on a cached prefix in one step, plus three
    CUDA-graph padding rows that must come back zero."""
    variant = variants(num_heads)[name]
    query, key, value, cache, meta = _filled_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, pad=3)
    n, scale = meta.num_actual_tokens, head_size**-0.5
    out = triton_backend.paged_attention(query, key, value, cache, meta, scale, variant)
    assert out.shape == query.shape
    torch.testing.assert_close(out[:n].double(), dense_reference(query[:n], cache, meta, scale, variant), **FP32_TOL)
    assert torch.count_nonzero(out[n:]) == 0


@pytest.mark.parametrize("name", ["window_7", "sinks", "all"])
def test_split_k_decode_matches_dense_reference(name):
    """Splits share only the window's tiles; the sink is counted once across the splits."""
    specs = [(0, 1), (3, 1), (64, 1), (200, 1), (127, 1)]
    variant = variants(8)[name]
    query, _, _, cache, meta = _filled_batch(specs, 8, 2, 32, 16, seed=1)
    expected = dense_reference(query, cache, meta, 0.3, variant)
    for num_splits in (2, 4):
        out = torch.full_like(query, float("nan"))
        paged_decode(out, query, cache, meta.block_table, meta.seq_lens, meta.num_decodes, 0.3,
                     num_splits=num_splits, variant=variant)
        torch.testing.assert_close(out.double(), expected, **FP32_TOL)


@pytest.mark.parametrize("name", ["window_1", "window_7", "all"])
def test_prefill_tiles_across_the_window_edge(name):
    """block_m=16 with GQA 4: 4 query tokens per tile, so most tiles need the window mask
    for some rows, skip tiles for all of them, and run the unmasked loop in between."""
    specs = [(0, 13), (50, 30), (1, 1), (150, 20)]
    variant = variants(8)[name]
    query, _, _, cache, meta = _filled_batch(specs, 8, 2, 16, 16, seed=2)
    out = torch.full_like(query, float("nan"))
    paged_prefill(out, query, cache, meta.block_table, meta.seq_lens, meta.query_start_loc, 0, len(specs),
                  meta.max_query_len, 0.25, block_m=16, variant=variant)
    torch.testing.assert_close(out.double(), dense_reference(query, cache, meta, 0.25, variant), **FP32_TOL)


def test_tiles_before_the_window_are_never_read():
    """Long contexts cost only the window: every cache position in a 32-key tile that lies
    wholly before the first visible key holds NaN, and the output is still exact."""
    specs = [(200, 1), (150, 10)]
    variant = AttentionVariant(sliding_window=7, sinks=torch.linspace(-1.0, 1.0, 4))
    query, key, value, cache, meta = _filled_batch(specs, 4, 2, 16, 16, seed=7)
    expected = dense_reference(query, cache, meta, 0.25, variant)
    # The decode (position 200) sees 194..200, tile 6 from 192; the chunk's first query
    # (position 150) sees 144.., tile 4 from 128.
    for seq, first_read in ((0, 192), (1, 128)):
        blocks = meta.block_table[seq, : first_read // 16].long()
        cache[:, blocks] = float("nan")
    out = triton_backend.paged_attention(query, key, value, cache, meta, 0.25, variant)
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


@pytest.mark.parametrize("name", ["soft_cap", "all"])
def test_half_precision_matches_torch_reference(name):
    """fp16 stands in for bf16 (see the module docstring)."""
    variant = variants(4)[name]
    query, key, value, cache, meta = _filled_batch(MIXED[2:6], 4, 2, 64, 16, dtype=torch.float16, seed=4)
    ref = torch_ref.paged_attention(query.float(), key.float(), value.float(), cache.float(), meta, 0.125, variant)
    out = triton_backend.paged_attention(query, key, value, cache, meta, 0.125, variant)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_sinks_of_the_wrong_shape_are_refused():
    query, key, value, cache, meta = _filled_batch([(3, 1)], 4, 2, 16, 16)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\); got shape \(2,\)"):
        triton_backend.paged_attention(query, key, value, cache, meta, 0.25, AttentionVariant(sinks=torch.zeros(2)))
