"""Weight-only quantization of linear layers at load (`--quantization int8|int4`): weights
stored in 8 or 4 bits with fp32 scales, activations and adapters in the model's dtype.

Semantics (the native kernel vllm/csrc/cpu/quant_linear.cpp computes the same):
    int8: per output channel (group = K): q = round(W / s) in [-127, 127], s = max|W[n]| / 127
    int4: groups of `INT4_GROUP` (32, GGUF Q4_0's block) input features per output channel:
          q = round(W / s) in [-8, 7], s = max|W[n, group]| / 7 (the largest magnitude maps to
          +-7, so it round-trips exactly); stored as q + 8, two per byte: in each block of 32,
          byte j holds element j (low nibble) and element j + 16 (high nibble)
    W' = s * q; a quantized layer computes x @ W'.T + bias.

Invariants:
  - `QuantizedWeight.dequantize()` is the reference: the native kernel and the torch path both
    equal x @ dequantize().T up to fp32 summation order.
  - Few rows (decodes, short chunks) run the native kernel, which reads every weight byte once
    per call; many rows (prefills) dequantize tiles of `TILE_ROWS` output channels and run a
    dense matmul, where compute dominates anyway. Without the native kernel every call takes the
    tiled torch path.
  - Only the base weights are quantized: LoRA slots, embeddings and the LM head stay in the
    model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from vllm import native_build

METHODS = ("int8", "int4")
INT4_GROUP = 32
TILE_ROWS = 1024  # output channels dequantized at once on the dense path (bounds the temporary)
NATIVE_MAX_ROWS = 16  # up to this many rows of x use the native kernel
_SOURCE, _WHAT = "quant_linear.cpp", "CPU quantized-linear kernel"


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    method: str  # "int8" | "int4"
    qweight: torch.Tensor  # int8 [N, K] or uint8 [N, K / 2]
    scales: torch.Tensor  # fp32 [N, K / group]
    group: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:  # fp32 [N, K] (or the rows asked for)
        q = self.qweight[rows]
        if self.method == "int4":
            blocks = q.view(q.shape[0], -1, INT4_GROUP // 2)  # [n, K / 32, 16] bytes
            low = (blocks & 0x0F).to(torch.int8) - 8
            high = (blocks >> 4).to(torch.int8) - 8
            q = torch.cat([low, high], dim=-1).view(q.shape[0], self.in_features)
        scales = self.scales[rows].repeat_interleave(self.group, dim=1)
        return q.float() * scales


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """weight: [N, K] floating. Round to nearest, symmetric, as the module docstring states."""
    if method not in METHODS:
        raise ValueError(f"Unknown quantization {method!r}; supported: {', '.join(METHODS)}.")
    n, k = weight.shape
    w = weight.detach().float()
    if method == "int8":
        scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N, 1]
        q = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q.contiguous(), scales.contiguous(), k, k)
    if k % INT4_GROUP:
        raise ValueError(f"int4 quantization needs input sizes that are multiples of {INT4_GROUP}, got {k}.")
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    scales = (groups.abs().amax(dim=2) / 7).clamp(min=torch.finfo(torch.float32).tiny)  # [N, K / 32]
    q = torch.round(groups / scales[..., None]).clamp(-8, 7).to(torch.int16) + 8  # [N, K / 32, 32] in 0..15
    half = INT4_GROUP // 2
    packed = (q[..., :half] | (q[..., half:] << 4)).to(torch.uint8).view(n, k // 2)
    return QuantizedWeight("int4", packed.contiguous(), scales.contiguous(), INT4_GROUP, k)


def native_available() -> bool:
    return native_build.unavailable_reason(_SOURCE, _WHAT) is None


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x: [M, K] in the model dtype -> [M, N] in the model dtype."""
    xf = x.float().contiguous()
    if x.device.type == "cpu" and xf.shape[0] <= NATIVE_MAX_ROWS and native_available():
        out = torch.empty(xf.shape[0], weight.out_features, dtype=torch.float32)
        op = torch.ops.vllm_quant.linear_int8 if weight.method == "int8" else torch.ops.vllm_quant.linear_int4
        op(out, xf, weight.qweight, weight.scales, weight.group)
    else:
        out = torch.cat([F.linear(xf, weight.dequantize(slice(start, start + TILE_ROWS)))
                         for start in range(0, weight.out_features, TILE_ROWS)], dim=1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
