"""`RMSNorm` with the exact numerics of HF's LlamaRMSNorm, plus vLLM's fused
residual add.

HF computes in float32 and casts back before multiplying by the weight:
    out = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
We keep that order so results match HF bit for bit in fp32 and to rounding in bf16.

`forward(x, residual)`: residual' = x + residual (in the model dtype, as HF's
`residual + hidden_states`), out = norm(residual'); returns (out, residual').
`x` is consumed: it is overwritten with the sum, saving one allocation per layer.

On the CPU, in fp32 and bf16, `RMSNorm` (not its subclasses) runs the native kernel of
vllm/csrc/cpu/fused_norm.cpp when x (and the residual) are contiguous: the add and the norm
in one pass over each row instead of about ten small torch ops, each with its own
allocation. Its residual sum is bit for bit torch's; its output agrees with the torch path
to fp32 rounding (the sum of squares runs in another order), so the exact-HF property
above belongs to the torch path (`forward_native`), which stays the reference and the
fallback (no compiler, VLLM_USE_TORCH_REFERENCE_OPS, other dtypes or devices).

`GemmaRMSNorm` (Gemma 1/2/3, and Gemma 3's q/k norms) stores the weight as an offset
from 1 and multiplies in float32 before the cast back, as HF's GemmaRMSNorm:
    out = (x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + weight.float())).to(x.dtype)
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from vllm import envs, native_build
from vllm.model_executor.layers.linear import default_weight_loader

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def native_unavailable_reason() -> Optional[str]:
    """Builds (first time on this machine) or loads the fused norm kernel. None on success,
    else why not (also logged once as a warning)."""
    return native_build.unavailable_reason("fused_norm.cpp", "CPU fused RMSNorm kernel")


class RMSNorm(nn.Module):
    identity_weight = 1.0  # the weight value that leaves the normalised x unchanged

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        # Subclasses with other numerics (Gemma's 1 + weight) keep the torch path. The kernel
        # is built (or loaded) here, while the model is built, not by the first request.
        self._native = (device.type == "cpu" and dtype in _NATIVE_DTYPES and type(self)._norm is RMSNorm._norm
                        and not envs.VLLM_USE_TORCH_REFERENCE_OPS and native_unavailable_reason() is None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # the same tensor when x is fp32: nothing below writes into it
        variance = h.pow(2).mean(-1, keepdim=True)
        out = h * torch.rsqrt(variance + self.eps)  # a fresh tensor
        out = out.to(x.dtype)  # no-op in fp32; a fresh tensor otherwise
        return out.mul_(self.weight)  # HF: weight * out; multiplication commutes exactly

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self._native and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            return self.forward_cpu(x, residual)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The torch path: HF's numerics exactly (the reference)."""
        if residual is None:
            return self._norm(x)
        residual = x.add_(residual)
        return self._norm(residual), residual

    def forward_cpu(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The native kernel; x (and residual) contiguous, fp32 or bf16, on the CPU."""
        rows = x.view(-1, self.hidden_size)  # [num_tokens (x leading dims), hidden]
        out = torch.empty_like(rows)
        if residual is None:
            torch.ops.vllm_norm.rms_norm(out, rows, self.weight, self.eps)
            return out.view(x.shape)
        # x becomes x + residual, as on the torch path.
        torch.ops.vllm_norm.fused_add_rms_norm(out, rows, residual.view(-1, self.hidden_size), self.weight, self.eps)
        return out.view(x.shape), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `x * (1 + weight)`, the product in float32 (see module docstring).
    The fused residual add is the base class's: the sum stays in the model dtype, as HF's
    `residual + hidden_states`."""

    identity_weight = 0.0

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # a fresh fp32 tensor
        return out.mul_(1.0 + self.weight.float()).to(x.dtype)
