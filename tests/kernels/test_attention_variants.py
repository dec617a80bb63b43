"""Attention variants (sliding window, logit soft cap, sinks; vllm/attention/variant.py) in the
torch reference backend against a dense per-token computation in float64 written from the
variant's stated semantics. The same batches (decodes, fresh prefills, chunks over a cached
prefix, shuffled blocks, GQA) are the oracle for the native and Triton backends."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention import MIXED, make_batch
from vllm.attention.backends import torch_ref
from vllm.attention.variant import PLAIN, AttentionVariant


def dense_reference(query, cache, meta, scale, variant: AttentionVariant) -> torch.Tensor:
    """One query token at a time: its keys read position by position through the block
    table, scores capped, masked by the window, softmaxed with the sink (float64)."""
    _, _, block_size, num_kv_heads, _ = cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(meta.num_actual_tokens, num_heads, query.shape[2], dtype=torch.float64)
    qsl, lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    for i in range(meta.num_seqs):
        positions = torch.arange(lens[i])
        slots = meta.block_table[i, positions // block_size].long() * block_size + positions % block_size
        keys = cache[0].reshape(-1, num_kv_heads, cache.shape[-1])[slots].double()  # [L, Hkv, D]
        values = cache[1].reshape(-1, num_kv_heads, cache.shape[-1])[slots].double()
        q_len = qsl[i + 1] - qsl[i]
        for j in range(q_len):
            t, p = qsl[i] + j, lens[i] - q_len + j
            for h in range(num_heads):
                s = keys[: p + 1, h // group] @ query[t, h].double() * scale  # [p + 1]
                if variant.soft_cap is not None:
                    s = torch.tanh(s / variant.soft_cap) * variant.soft_cap
                if variant.sliding_window is not None:
                    s[: max(0, p - variant.sliding_window + 1)] = float("-inf")
                if variant.sinks is not None:
                    s = torch.cat([s, variant.sinks[h].double().view(1)])
                probs = torch.softmax(s, 0)[: p + 1]
                out[t, h] = probs @ values[: p + 1, h // group]
    return out


def variants(num_heads: int) -> dict[str, AttentionVariant]:
    sinks = torch.linspace(-2.0, 3.0, num_heads)
    return {
        "plain": PLAIN,
        "window_1": AttentionVariant(sliding_window=1),
        "window_7": AttentionVariant(sliding_window=7),
        "window_32": AttentionVariant(sliding_window=32),
        "soft_cap": AttentionVariant(soft_cap=2.0),
        "sinks": AttentionVariant(sinks=sinks),
        "all": AttentionVariant(sliding_window=20, soft_cap=3.0, sinks=sinks),
    }


@pytest.mark.parametrize("name", list(variants(1)))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size", [(4, 2, 16, 8), (6, 6, 8, 16)])
def test_torch_ref_matches_dense_reference(name, num_heads, num_kv_heads, head_size, block_size):
    variant = variants(num_heads)[name]
    query, key, value, cache, meta = make_batch(MIXED, num_heads, num_kv_heads, head_size, block_size)
    n, scale = meta.num_actual_tokens, head_size**-0.5
    torch_ref.store_kv(key[:n], value[:n], cache, meta.slot_mapping[:n])
    out = torch_ref.paged_attention(query[:n], key[:n], value[:n], cache, meta, scale, variant)
    expected = dense_reference(query[:n], cache, meta, scale, variant)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


def test_window_wider_than_context_is_plain():
    query, key, value, cache, meta = make_batch(MIXED, 4, 2, 16, 8)
    n = meta.num_actual_tokens
    torch_ref.store_kv(key[:n], value[:n], cache, meta.slot_mapping[:n])
    plain = torch_ref.paged_attention(query[:n], key[:n], value[:n], cache, meta, 0.25)
    wide = torch_ref.paged_attention(query[:n], key[:n], value[:n], cache, meta, 0.25,
                                     AttentionVariant(sliding_window=10_000))
    torch.testing.assert_close(wide, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("field, value, match", [("sliding_window", 0, "positive number of positions"),
                                                 ("soft_cap", -1.0, "soft cap must be positive")])
def test_bad_variant_is_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        AttentionVariant(**{field: value})
