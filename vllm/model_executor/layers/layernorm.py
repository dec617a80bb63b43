"""`RMSNorm` with the exact numerics of HF's LlamaRMSNorm, plus vLLM's fused
residual add.

HF computes in float32 and casts back before multiplying by the weight:
    out = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
We keep that order so results match HF bit for bit in fp32 and to rounding in bf16.

`forward(x, residual)`: residual' = x + residual (in the model dtype, as HF's
`residual + hidden_states`), out = norm(residual'); returns (out, residual').
`x` is consumed: it is overwritten with the sum, saving one allocation per layer.

`GemmaRMSNorm` (Gemma 1/2/3, and Gemma 3's q/k norms) stores the weight as an offset
from 1 and multiplies in float32 before the cast back, as HF's GemmaRMSNorm:
    out = (x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + weight.float())).to(x.dtype)
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from vllm.model_executor.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    identity_weight = 1.0  # the weight value that leaves the normalised x unchanged

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # the same tensor when x is fp32: nothing below writes into it
        variance = h.pow(2).mean(-1, keepdim=True)
        out = h * torch.rsqrt(variance + self.eps)  # a fresh tensor
        out = out.to(x.dtype)  # no-op in fp32; a fresh tensor otherwise
        return out.mul_(self.weight)  # HF: weight * out; multiplication commutes exactly

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if residual is None:
            return self._norm(x)
        residual = x.add_(residual)
        return self._norm(residual), residual

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
