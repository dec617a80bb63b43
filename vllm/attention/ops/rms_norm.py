"""Triton fused RMSNorm (+ residual add), the GPU counterpart of
vllm/model_executor/layers/layernorm.RMSNorm (HF LlamaRMSNorm numerics).

Semantics:
    without residual:  out = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
    with residual:     s = (x + residual) rounded to x.dtype; x is overwritten with s;
                       out = the same norm of s; returns (out, s)
    The weight multiply happens on the value already rounded to x.dtype, as HF does;
    the product of two bf16 numbers is exact in fp32, so rounding it once matches
    torch's bf16 multiply bit for bit.

Invariants: one program per row with the whole row in one tile (hidden sizes up to a
few tens of thousands), sums of squares in fp32; rows may be strided views.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]; receives x + residual when HAS_RESIDUAL
    residual_ptr,  # [num_tokens, hidden] (unused without residual)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # HF adds in model dtype
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(hidden: int, has_residual: bool) -> dict:
    """Constexprs and launch options of _rms_norm_kernel: the one table rms_norm and
    benchmarks/triton_aot.py both use."""
    block = triton.next_power_of_2(hidden)
    return dict(BLOCK=block, HAS_RESIDUAL=has_residual, num_warps=min(16, max(1, block // 256)))


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: Optional[torch.Tensor] = None,  # [num_tokens, hidden]
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Returns out, or (out, x + residual) with x overwritten by the sum."""
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows contiguous in their last dimension.")
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out if residual is None else (out, x)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        hidden,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        **rms_norm_launch(hidden, residual is not None),
    )
    return out if residual is None else (out, x)
