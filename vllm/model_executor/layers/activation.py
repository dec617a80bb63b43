"""`SiluAndMul`, vLLM's gated MLP activation: for x = [gate | up] along the last dim,
`silu(gate) * up`, half x's width.

The torch path (`forward_native`: F.silu, then the product, each rounding to the model dtype as
HF's LlamaMLP does) is the reference and the fallback (no compiler, VLLM_USE_TORCH_REFERENCE_OPS,
other devices and dtypes). On the CPU, in fp32 and bf16, contiguous x runs the native kernel of
vllm/csrc/cpu/activation.cpp: both steps in one pass over each row, rounding where torch rounds,
its exp within 2 ulp of torch's (fp32 results a few ulp apart; bf16 the same value unless the
fp32 one sits on a rounding boundary). The native decoder layers (decode_layer.py) call the same
kernel, so a layer's native and Python forms stay bitwise equal.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vllm import envs, native_build

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def native_unavailable_reason() -> Optional[str]:
    """Builds (first time on this machine) or loads the activation kernel. None on success,
    else why not (also logged once as a warning)."""
    return native_build.unavailable_reason("activation.cpp", "CPU SiLU-and-mul kernel")


class SiluAndMul:
    """[..., 2 d] -> [..., d]: silu(x[..., :d]) * x[..., d:], for x of the dtype and device it was
    made for. A plain callable, not an nn.Module: it holds no weights, and at a decode's one row
    a module call's overhead (~2 us) would be most of its cost."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        # Built (or loaded) here, while the model is built, not by the first request.
        self.native = (device.type == "cpu" and dtype in _NATIVE_DTYPES and not envs.VLLM_USE_TORCH_REFERENCE_OPS
                       and native_unavailable_reason() is None)
        self._op = torch.ops.vllm_act.silu_and_mul.default if self.native else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.is_contiguous():
            return self.forward_cpu(x)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        """The torch path: HF's numerics exactly (the reference)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The native kernel; x contiguous, of the dtype this was made for, on the CPU."""
        if x.dim() == 2:  # [num_tokens, 2 d]: the MLP's case, without views
            out = x.new_empty((x.shape[0], x.shape[1] // 2))
            self._op(out, x)
            return out
        rows = x.view(-1, x.shape[-1])
        out = x.new_empty((rows.shape[0], x.shape[-1] // 2))
        self._op(out, rows)
        return out.view(*x.shape[:-1], x.shape[-1] // 2)
