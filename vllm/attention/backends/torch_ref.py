"""Torch reference attention over the paged KV cache (the CPU path and the oracle of
the Triton kernels).

Semantics (see vllm/attention/metadata.py for the layout):
  store_kv:       kv_cache[0].flat[slot_mapping[t]] = key[t];  kv_cache[1].flat[...] = value[t]
                  for every t with slot_mapping[t] >= 0.
  paged_attention: for sequence i with KV length L and query length q, query token j
                  sits at position L - q + j and attends to positions 0 .. L - q + j
                  (causal on top of the cached prefix). GQA: query head h reads KV
                  head h // (num_heads // num_kv_heads).

Decodes are computed as one padded batch of whole blocks; prefills one sequence at a time. A prefill
with no cached prefix reads the new keys and values directly, without a gather. A backend may hand
the sequences with few query tokens to a faster kernel (`short`); the rest still run here.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from vllm.attention.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_size]; kv_cache: [2, num_blocks, block_size, Hkv, D]."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _decode_index(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block ids [num_decodes * num_blocks], key mask [num_decodes, num_blocks * block_size] and
    num_blocks, shared by every layer of a step. Whole blocks are gathered (one contiguous copy
    per block, not per token); positions past a sequence's length are masked."""
    cache = meta.__dict__.setdefault("_torch_ref_cache", {})
    if "decode" not in cache:
        d = meta.num_decodes
        max_len = int(meta.seq_lens_cpu[:d].max())
        num_blocks = -(-max_len // block_size)
        blocks = meta.block_table[:d, :num_blocks].long().reshape(-1)
        positions = torch.arange(num_blocks * block_size, device=blocks.device)
        mask = positions[None, :] < meta.seq_lens[:d, None].long()
        cache["decode"] = (blocks, mask, num_blocks)
    return cache["decode"]


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode rows as one padded batch. Query heads that share a KV head are laid out as
    that head's query rows, so no KV head is ever expanded. # [num_decodes, H, D]"""
    d = meta.num_decodes
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    blocks, mask, num_blocks = _decode_index(meta, block_size)
    k = kv_cache[0].index_select(0, blocks).view(d, num_blocks * block_size, num_kv_heads, head_size)
    v = kv_cache[1].index_select(0, blocks).view(d, num_blocks * block_size, num_kv_heads, head_size)
    group = query.shape[1] // num_kv_heads
    q = query[:d].view(d, num_kv_heads, group, head_size)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
                                         scale=scale)  # [d, Hkv, group, D]
    return out.reshape(d, num_kv_heads * group, head_size)


def prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size]; rows of prefill sequences are written
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (this step's keys)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    meta: AttentionMetadata,
    scale: float,
    min_query_len: int = 1,
) -> None:
    """The sequences num_decodes onwards of paged_attention with at least `min_query_len` query
    tokens, one at a time."""
    num_kv_heads = kv_cache.shape[-2]
    gqa = query.shape[1] != num_kv_heads
    qsl = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end, kv_len = qsl[i], qsl[i + 1], seq_lens[i]
        if end - start < min_query_len:
            continue
        if kv_len == end - start:  # no cached prefix: the new keys are all there is
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            k = key[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q_len, D]
            v = value[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        else:
            out[start:end] = _attend_with_context(query[start:end], kv_cache, meta.block_table[i], kv_len, scale)


def _attend_with_context(
    query: torch.Tensor,  # [q_len, H, D], the newest tokens of a sequence of kv_len tokens
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    kv_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, H, D]
    """New tokens on top of a cached prefix (chunked prefill, an aLoRA's few tokens after a
    long conversation): whole blocks are gathered (one contiguous copy per block), query
    token j attends to positions 0 .. kv_len - q_len + j."""
    q_len, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    blocks = block_table_row[: -(-kv_len // block_size)].long()
    k = kv_cache[0].index_select(0, blocks).view(-1, num_kv_heads, head_size)[:kv_len]  # [kv_len, Hkv, D]
    v = kv_cache[1].index_select(0, blocks).view(-1, num_kv_heads, head_size)[:kv_len]
    positions = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
    mask = torch.arange(kv_len, device=query.device)[None, :] <= positions  # [q_len, kv_len]
    o = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)  # [1, H, q_len, D]
    return o[0].transpose(0, 1)


def decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> int:
    """Writes out[:num_decodes], the decode rows of paged_attention, and nothing else (returns 0)."""
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(query, kv_cache, meta, scale)
    return 0


# (out, query, kv_cache, meta, scale) -> n: computes the decode rows (sequences 0:num_decodes) and
# those of every later sequence with at most n query tokens, and returns n (0: only the decodes).
ShortFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], int]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (this step's keys)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    meta: AttentionMetadata,
    scale: float,
    short: ShortFn = decode_attention,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """`short` computes the sequences with few query tokens (a native kernel may stand in for
    the reference decode); the longer ones run prefill_attention."""
    out = torch.empty_like(query)
    computed = short(out, query, kv_cache, meta, scale)
    prefill_attention(out, query, key, value, kv_cache, meta, scale, min_query_len=computed + 1)
    return out
