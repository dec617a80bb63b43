"""Triton attention backend (the CUDA path): the same two functions, with the same
signatures and semantics, as vllm/attention/backends/torch_ref.py.

- store_kv: scatter this step's keys and values into the paged cache (-1 slots skipped).
- paged_attention: decodes (sequences 0:num_decodes, one token each) run the split-K
  decode kernel; the remaining sequences (prefills, chunks on a cached prefix) run the
  tiled prefill kernel. Both read keys and values from the cache, so `key` / `value`
  are accepted for signature parity only. The layer's AttentionVariant (sliding window,
  soft cap, sinks) is compiled into both kernels (see vllm/attention/ops/paged_attention.py).

Invariant: only the first meta.num_actual_tokens rows are computed; rows past them
(CUDA-graph padding) are set to zero so no uninitialised memory leaks downstream.
This module imports triton, so it is only imported by the dispatcher on CUDA (or by
tests running the Triton interpreter).
"""

from __future__ import annotations

import torch

from vllm.attention.metadata import AttentionMetadata
from vllm.attention.variant import PLAIN, AttentionVariant
from vllm.attention.ops import kv_store
from vllm.attention.ops.paged_attention import paged_decode, paged_prefill


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_size]; kv_cache: [2, num_blocks, block_size, Hkv, D]."""
    kv_store.store_kv(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (unused: read from the cache)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (unused)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    meta: AttentionMetadata,
    scale: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    kv_store.check_slot_layout(kv_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous even if query is a view
    n = meta.num_actual_tokens
    if n < out.shape[0]:
        out[n:].zero_()
    if meta.num_decodes:
        paged_decode(out, query, kv_cache, meta.block_table, meta.seq_lens, meta.num_decodes, scale,
                     variant=variant)
    num_prefills = meta.num_seqs - meta.num_decodes
    if num_prefills:
        paged_prefill(
            out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
            meta.num_decodes, num_prefills, meta.max_query_len, scale, variant=variant,
        )
    return out
