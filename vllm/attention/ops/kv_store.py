"""Triton kernel that writes this step's keys and values into the paged KV cache.

Semantics:
    for every token t with slot = slot_mapping[t] >= 0:
        kv_cache[0].view(-1, num_kv_heads, head_size)[slot] = key[t]
        kv_cache[1].view(-1, num_kv_heads, head_size)[slot] = value[t]
    tokens with slot -1 are skipped (their program exits at once).

Invariants:
- One program per token copies all of that token's kv heads (num_kv_heads * head_size
  elements), so each program does one contiguous-ish read and one write per tensor.
- Slots are widened to int64 before being scaled by the slot stride: a large cache has
  more than 2**31 elements per layer.
- key / value may be strided views (e.g. column slices of a fused qkv output): only the
  last dimension must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    num_kv_heads,
    head_size,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_kv,  # distance between the key and the value half of the cache
    stride_c_slot,
    stride_c_head,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size)  # [BLOCK_H, BLOCK_D]
    k = tl.load(key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    dst = cache_ptr + slot * stride_c_slot + heads[:, None] * stride_c_head + dims[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv_launch(num_kv_heads: int, head_size: int) -> dict:
    """Constexprs and launch options of _store_kv_kernel: the one table store_kv and
    benchmarks/triton_aot.py both use. One warp per 256 elements of a token's [heads, dims]
    tile (4 to 16): 2048-element tiles on 4 warps (Gemma 2's 16 x 128 and 8 x 256) spilled in
    bf16/fp16, each thread holding 16 keys, 16 values and their 64-bit addresses (found by
    benchmarks/triton_aot.py)."""
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_size)
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(4, min(16, block_h * block_d // 256)))


def check_slot_layout(kv_cache: torch.Tensor) -> None:
    """The kernels address the cache by flat slot; that needs blocks laid out back to back."""
    _, _, block_size, _, head_size = kv_cache.shape
    if kv_cache.stride(1) != block_size * kv_cache.stride(2) or kv_cache.stride(4) != 1:
        raise ValueError(
            f"KV cache strides {tuple(kv_cache.stride())} do not allow flat slot addressing; "
            "allocate it contiguous as [2, num_blocks, block_size, num_kv_heads, head_size]."
        )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not store
) -> None:
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    check_slot_layout(kv_cache)
    num_kv_heads, head_size = kv_cache.shape[-2:]
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("store_kv needs key and value contiguous in their last dimension.")
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_kv_heads,
        head_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        **store_kv_launch(num_kv_heads, head_size),
    )
