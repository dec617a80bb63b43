"""Torch reference attention over the paged KV cache (the CPU path and the oracle of
the Triton kernels).

Semantics (see vllm/attention/metadata.py for the layout):
  store_kv:       kv_cache[0].flat[slot_mapping[t]] = key[t];  kv_cache[1].flat[...] = value[t]
                  for every t with slot_mapping[t] >= 0 (rounded to the cache's dtype).
  paged_attention: for sequence i with KV length L and query length q, query token j
                  sits at position L - q + j and attends to positions 0 .. L - q + j
                  (causal on top of the cached prefix). GQA: query head h reads KV
                  head h // (num_heads // num_kv_heads). A layer's AttentionVariant
                  (sliding window, logit soft cap, sinks; vllm/attention/variant.py)
                  narrows the positions or changes the scores as documented there.
                  Keys and values are those the cache holds: where its dtype is narrower
                  than the query's (a bf16 cache under an fp32 model) they are read back
                  widened, and a prompt's own new keys are rounded the same way, so a
                  result never depends on whether its keys came from this step or the cache.

Decodes are computed as one padded batch of whole blocks; prefills one sequence at a time. A prefill
with no cached prefix reads the new keys and values directly, without a gather; with a sliding window only the blocks
inside the window are gathered. Plain layers run SDPA; a soft cap or sinks materialise the
scores in fp32. A backend may hand the sequences with few query tokens to a faster kernel
(`short`); the rest still run here.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from vllm.attention.metadata import AttentionMetadata
from vllm.attention.variant import PLAIN, AttentionVariant


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_size]; kv_cache: [2, num_blocks, block_size, Hkv, D]."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _as_stored(x: torch.Tensor, kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache holds it (rounded to its dtype), in `dtype`: the identity when they agree."""
    return x if kv_cache.dtype == x.dtype == dtype else x.to(kv_cache.dtype).to(dtype)


def _attend(
    query: torch.Tensor,  # [B, num_heads, M, D]
    key: torch.Tensor,  # [B, num_kv_heads, L, D]
    value: torch.Tensor,  # [B, num_kv_heads, L, D]
    mask: torch.Tensor,  # bool, broadcastable to [B, num_heads, M, L]; True: attend
    scale: float,
    variant: AttentionVariant,
) -> torch.Tensor:  # [B, num_heads, M, D]
    """Masked softmax attention with the variant's soft cap and sinks."""
    gqa = query.shape[1] != key.shape[1]
    if not variant.needs_scores:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # [B, H, M, L]
    if variant.soft_cap is not None:
        scores = torch.tanh(scores / variant.soft_cap) * variant.soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    length = scores.shape[-1]
    if variant.sinks is not None:
        sink = variant.sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :length]
    return torch.matmul(probs.to(value.dtype), value)


def _decode_index(meta: AttentionMetadata, block_size: int,
                  window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block ids [num_decodes * num_blocks], key mask [num_decodes, num_blocks * block_size] and
    num_blocks, shared by every layer of a step with the same window. Whole blocks are gathered
    (one contiguous copy per block, not per token); positions past a sequence's length, or
    before its window, are masked."""
    cache = meta.__dict__.setdefault("_torch_ref_cache", {})
    if ("decode", window) not in cache:
        d = meta.num_decodes
        max_len = int(meta.seq_lens_cpu[:d].max())
        num_blocks = -(-max_len // block_size)
        blocks = meta.block_table[:d, :num_blocks].long().reshape(-1)
        positions = torch.arange(num_blocks * block_size, device=blocks.device)
        seq_lens = meta.seq_lens[:d, None].long()
        mask = positions[None, :] < seq_lens
        if window is not None:
            mask &= positions[None, :] >= seq_lens - window
        cache[("decode", window)] = (blocks, mask, num_blocks)
    return cache[("decode", window)]


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            variant: AttentionVariant) -> torch.Tensor:
    """Decode rows as one padded batch. Query heads that share a KV head are laid out as
    that head's query rows, so no KV head is ever expanded. # [num_decodes, H, D]"""
    d = meta.num_decodes
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    blocks, mask, num_blocks = _decode_index(meta, block_size, variant.sliding_window)
    k = kv_cache[0].index_select(0, blocks).view(d, num_blocks * block_size, num_kv_heads, head_size)
    v = kv_cache[1].index_select(0, blocks).view(d, num_blocks * block_size, num_kv_heads, head_size)
    k, v = _as_stored(k, kv_cache, query.dtype), _as_stored(v, kv_cache, query.dtype)
    num_heads = query.shape[1]
    if variant.needs_scores:  # one query row per head: [d, H, 1, D]
        out = _attend(query[:d].view(d, num_heads, 1, head_size), k.transpose(1, 2), v.transpose(1, 2),
                      mask[:, None, None, :], scale, variant)
        return out.view(d, num_heads, head_size)
    q = query[:d].view(d, num_kv_heads, num_heads // num_kv_heads, head_size)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
                                         scale=scale)  # [d, Hkv, group, D]
    return out.reshape(d, num_heads, head_size)


def prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size]; rows of prefill sequences are written
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (this step's keys)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    meta: AttentionMetadata,
    scale: float,
    min_query_len: int = 1,
    variant: AttentionVariant = PLAIN,
) -> None:
    """The sequences num_decodes onwards of paged_attention with at least `min_query_len` query
    tokens, one at a time."""
    if meta.max_query_len < min_query_len:  # nothing to do (every decode step): skip the host copies
        return
    num_kv_heads = kv_cache.shape[-2]
    gqa = query.shape[1] != num_kv_heads
    qsl = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end, kv_len = qsl[i], qsl[i + 1], seq_lens[i]
        if end - start < min_query_len:
            continue
        if kv_len != end - start:
            out[start:end] = _attend_with_context(query[start:end], kv_cache, meta.block_table[i], kv_len, scale,
                                                  variant)
            continue
        # No cached prefix: the new keys, as the cache holds them, are all there is.
        k = _as_stored(key[start:end], kv_cache, query.dtype)  # [q_len, Hkv, D]
        v = _as_stored(value[start:end], kv_cache, query.dtype)
        if variant.is_plain:
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               is_causal=True, scale=scale, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
        else:
            out[start:end] = _attend_window(query[start:end], k, v, 0, scale, variant)


def _attend_window(
    query: torch.Tensor,  # [q_len, H, D], the newest tokens of the sequence
    key: torch.Tensor,  # [n, Hkv, D], the keys at positions first .. first + n - 1 (the last query's)
    value: torch.Tensor,  # [n, Hkv, D]
    first: int,  # position of key[0]
    scale: float,
    variant: AttentionVariant,
) -> torch.Tensor:  # [q_len, H, D]
    """Query token j sits at position first + n - q_len + j and attends to the keys at
    positions up to its own, within its window."""
    q_len, n = query.shape[0], key.shape[0]
    q_pos = torch.arange(q_len, device=query.device)[:, None] + (first + n - q_len)
    k_pos = torch.arange(n, device=query.device)[None, :] + first
    mask = k_pos <= q_pos  # [q_len, n]
    if variant.sliding_window is not None:
        mask &= k_pos > q_pos - variant.sliding_window
    o = _attend(query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0),
                value.transpose(0, 1).unsqueeze(0), mask, scale, variant)  # [1, H, q_len, D]
    return o[0].transpose(0, 1)


def _attend_with_context(
    query: torch.Tensor,  # [q_len, H, D], the newest tokens of a sequence of kv_len tokens
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    kv_len: int,
    scale: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:  # [q_len, H, D]
    """New tokens on top of a cached prefix (chunked prefill, an aLoRA's few tokens after a
    long conversation): whole blocks are gathered (one contiguous copy per block), from the
    first block any query's window reaches."""
    q_len, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    first_block = variant.first_visible(kv_len - q_len) // block_size
    blocks = block_table_row[first_block : -(-kv_len // block_size)].long()
    first = first_block * block_size
    k = kv_cache[0].index_select(0, blocks).view(-1, num_kv_heads, head_size)[: kv_len - first]  # [n, Hkv, D]
    v = kv_cache[1].index_select(0, blocks).view(-1, num_kv_heads, head_size)[: kv_len - first]
    return _attend_window(query, _as_stored(k, kv_cache, query.dtype), _as_stored(v, kv_cache, query.dtype), first,
                          scale, variant)


def decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, variant: AttentionVariant = PLAIN) -> int:
    """Writes out[:num_decodes], the decode rows of paged_attention, and nothing else (returns 0)."""
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(query, kv_cache, meta, scale, variant)
    return 0


# (out, query, kv_cache, meta, scale, variant) -> n: computes the decode rows (sequences
# 0:num_decodes) and those of every later sequence with at most n query tokens, and returns n
# (0: only the decodes).
ShortFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, AttentionVariant], int]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (this step's keys)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    meta: AttentionMetadata,
    scale: float,
    variant: AttentionVariant = PLAIN,
    short: ShortFn = decode_attention,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """`short` computes the sequences with few query tokens (a native kernel may stand in for
    the reference decode); the longer ones run prefill_attention."""
    out = torch.empty_like(query)
    computed = short(out, query, kv_cache, meta, scale, variant)
    prefill_attention(out, query, key, value, kv_cache, meta, scale, min_query_len=computed + 1, variant=variant)
    return out
