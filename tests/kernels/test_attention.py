"""Triton KV store and paged attention vs the torch reference (run by the Triton
interpreter on CPU). Batches mix decodes, fresh prefills and chunks on a cached prefix,
with shuffled block ids, GQA and padded head sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllm.attention.backends import torch_ref, triton_backend
from vllm.attention.metadata import AttentionMetadata
from vllm.attention.ops.paged_attention import paged_decode, paged_prefill

# (context_len, query_len) per sequence; decodes (query_len 1) first.
MIXED = [(0, 1), (16, 1), (69, 1), (130, 1), (0, 9), (37, 20), (64, 1), (5, 70)]


def make_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype=torch.float32, pad=0, seed=0):
    """Random query/key/value, a cache whose prefix slots already hold the context, and
    the metadata. Block ids are a random permutation; unused cache blocks hold noise so
    reading a wrong slot shows up. `pad` extra rows mimic CUDA-graph padding."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(specs), max(blocks_per_seq) + 2, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_table[i, :nb] = perm[used : used + nb].int()
        used += nb
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)

    num_tokens = sum(q for _, q in specs)
    slots = []
    for i, (context, q_len) in enumerate(specs):
        pos = torch.arange(context, context + q_len)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots + [torch.full((pad,), -1, dtype=torch.long)])
    query = torch.randn(num_tokens + pad, num_heads, head_size, generator=gen).to(dtype)
    key = torch.randn(num_tokens + pad, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens + pad, num_kv_heads, head_size, generator=gen).to(dtype)

    qsl = torch.tensor([0] + [q for _, q in specs]).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_decodes=next((i for i, (_, q) in enumerate(specs) if q > 1), len(specs)),  # leading q == 1
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=lens,
        block_table=block_table,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=lens.clone(),
    )
    return query, key, value, cache, meta


def reference(query, key, value, cache, meta, scale):
    n = meta.num_actual_tokens
    cache = cache.clone()
    torch_ref.store_kv(key[:n], value[:n], cache, meta.slot_mapping[:n])
    return torch_ref.paged_attention(query[:n], key[:n], value[:n], cache, meta, scale), cache


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(4, 4, 16, 16), (4, 2, 64, 16), (8, 2, 16, 8), (6, 2, 40, 12), (8, 2, 128, 16)],
)
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_size, block_size):
    query, key, value, cache, meta = make_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, pad=3)
    assert meta.num_decodes == 4
    scale = head_size**-0.5
    ref, ref_cache = reference(query, key, value, cache, meta, scale)

    n = meta.num_actual_tokens
    triton_backend.store_kv(key[:n], value[:n], cache, meta.slot_mapping[:n])
    assert torch.equal(cache, ref_cache)
    out = triton_backend.paged_attention(query, key, value, cache, meta, scale)
    assert out.shape == query.shape
    torch.testing.assert_close(out[:n], ref, atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(out[n:]) == 0  # padding rows are zeroed, not garbage


@pytest.mark.parametrize("specs", [[(7, 1), (40, 1), (0, 1)], [(0, 33), (12, 5)]], ids=["decode-only", "prefill-only"])
def test_single_kind_batches(specs):
    query, key, value, cache, meta = make_batch(specs, 4, 1, 32, 16, seed=6)
    ref, cache = reference(query, key, value, cache, meta, 0.2)
    out = triton_backend.paged_attention(query, key, value, cache, meta, 0.2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_decode_split_k(num_splits):
    specs = [(0, 1), (3, 1), (64, 1), (200, 1), (127, 1)]
    query, key, value, cache, meta = make_batch(specs, 8, 2, 32, 16, seed=1)
    scale = 0.3
    ref, cache = reference(query, key, value, cache, meta, scale)
    out = torch.full_like(query, float("nan"))
    paged_decode(out, query, cache, meta.block_table, meta.seq_lens, meta.num_decodes, scale, num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_prefill_small_query_tiles():
    """block_m=16 with GQA 4 gives 4 query tokens per tile: many tiles cross the diagonal,
    and chunks on a prefix exercise both the unmasked and the causal loop."""
    specs = [(0, 13), (50, 30), (96, 7), (1, 1)]
    query, key, value, cache, meta = make_batch(specs, 8, 2, 16, 16, seed=2)
    assert meta.num_decodes == 0
    scale = 0.25
    ref, cache = reference(query, key, value, cache, meta, scale)
    out = torch.full_like(query, float("nan"))
    paged_prefill(out, query, cache, meta.block_table, meta.seq_lens, meta.query_start_loc, 0, 4,
                  meta.max_query_len, scale, block_m=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_strided_query_view():
    """The layer hands in views of a fused qkv projection: non-contiguous token stride."""
    specs = [(10, 1), (0, 5), (20, 4)]
    query, key, value, cache, meta = make_batch(specs, 4, 2, 16, 16, seed=3)
    n = meta.num_actual_tokens
    qkv = torch.cat([query.reshape(n, -1), key.reshape(n, -1), value.reshape(n, -1)], dim=1)
    q, k, v = qkv.split([4 * 16, 2 * 16, 2 * 16], dim=1)
    q, k, v = q.view(n, 4, 16), k.view(n, 2, 16), v.view(n, 2, 16)
    ref, ref_cache = reference(query, key, value, cache, meta, 0.25)
    triton_backend.store_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    out = triton_backend.paged_attention(q, k, v, cache, meta, 0.25)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_half_precision_matches_reference():
    """fp16 stands in for bf16: the interpreter runs tl.dot on bf16's raw bits (numpy has
    no bf16), so bf16 is checked on GPU by benchmarks/triton_kernels.py."""
    query, key, value, cache, meta = make_batch(MIXED[2:6], 4, 2, 64, 16, dtype=torch.float16, seed=4)
    ref, cache_ref = reference(query.float(), key.float(), value.float(), cache.float(), meta, 0.125)
    triton_backend.store_kv(key, value, cache, meta.slot_mapping)
    out = triton_backend.paged_attention(query, key, value, cache, meta, 0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_store_kv_skips_negative_slots():
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 6, 4, 2, 16, generator=gen)
    key = torch.randn(7, 2, 16, generator=gen)
    value = torch.randn(7, 2, 16, generator=gen)
    slots = torch.tensor([5, -1, 0, 23, -1, 12, 7])
    expected = cache.clone()
    torch_ref.store_kv(key, value, expected, slots)
    before = cache.clone()
    triton_backend.store_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    written = torch.zeros(2, 24, dtype=torch.bool)
    written[:, slots[slots >= 0]] = True
    assert torch.equal(cache.view(2, 24, 2, 16)[~written], before.view(2, 24, 2, 16)[~written])


def test_dispatchers_do_not_import_triton():
    code = (
        "import sys\n"
        "import vllm.attention.layer, vllm.attention.backends.torch_ref, vllm.lora.punica, vllm.lora.ops.torch_ops\n"
        "assert 'triton' not in sys.modules, 'triton imported at module import time'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
