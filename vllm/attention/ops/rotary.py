"""Triton rotary position embedding (rotate-half / GPT-NeoX style), the GPU counterpart
of vllm/model_executor/layers/rotary.RotaryEmbedding.forward.

Semantics, per token t at position p = positions[t], for every head of query and key,
with half = head_size // 2, x1 = x[:half], x2 = x[half:], c = cos_cache[p], s = sin_cache[p]:
    out[:half] = x1 * c - x2 * s
    out[half:] = x2 * c + x1 * s
Computed in fp32 from the cached cos/sin (already in the model dtype) and rounded once,
so bf16 results can differ from the torch path (which rounds after every op) by one ulp.

Invariants: one program per token rotates all query and key heads (cos/sin loaded once);
outputs are fresh contiguous tensors, inputs may be strided views of a fused qkv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_src_head, stride_dst_head, num_heads, half, c, s,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates num_heads heads of one token: src [heads, 2 * half] -> dst."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)  # [BLOCK_H, BLOCK_HALF]
    src = src_ptr + heads[:, None] * stride_src_head + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + heads[:, None] * stride_dst_head + dims[None, :]
    tl.store(dst, (x1 * c[None, :] - x2 * s[None, :]).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * c[None, :] + x1 * s[None, :]).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_ptr,  # [num_tokens, num_kv_heads, head_size]
    cos_ptr,  # [max_position, head_size // 2]
    sin_ptr,  # [max_position, head_size // 2]
    q_out_ptr,
    k_out_ptr,
    num_heads,
    num_kv_heads,
    half,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_cache,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + pos * stride_cache + dims, mask=dims < half, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cache + dims, mask=dims < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + tok * stride_q_tok, q_out_ptr + tok * stride_qo_tok, stride_q_head, stride_qo_head,
                  num_heads, half, c, s, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + tok * stride_k_tok, k_out_ptr + tok * stride_ko_tok, stride_k_head, stride_ko_head,
                  num_kv_heads, half, c, s, BLOCK_KH, BLOCK_HALF)


def rotary_launch(num_heads: int, num_kv_heads: int, head_size: int) -> dict:
    """Constexprs and launch options of _rotary_kernel: the one table rotary_embedding and
    benchmarks/triton_aot.py both use."""
    return dict(
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_size // 2),
        num_warps=4,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_cache: torch.Tensor,  # [max_position, head_size // 2]
    sin_cache: torch.Tensor,  # [max_position, head_size // 2]
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if (query.stride(-1) != 1 or key.stride(-1) != 1 or cos_cache.stride(-1) != 1
            or cos_cache.stride() != sin_cache.stride()):
        raise ValueError("rotary_embedding needs heads contiguous and cos/sin caches of one layout.")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_size // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_cache, sin_cache, q_out, k_out,
        num_heads, num_kv_heads, half,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_cache.stride(0),
        **rotary_launch(num_heads, num_kv_heads, head_size),
    )
    return q_out, k_out
