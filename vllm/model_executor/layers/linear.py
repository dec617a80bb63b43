"""`Linear`: a dense layer whose output may be several fused slices.

A fused layer (e.g. `qkv_proj` with `output_sizes=[q, k, v]`, or `gate_up_proj` with
`[gate, up]`) holds one weight `[sum(output_sizes), input_size]`; slice i occupies rows
`sum(output_sizes[:i]) ... sum(output_sizes[:i+1]) - 1`. Checkpoints store the slices
as separate tensors; `weight_loader` copies each into its rows.

Invariants:
- Parameters are allocated with `torch.empty` and never initialised here: the loader
  fills them one checkpoint tensor at a time, so loading never holds a second full
  copy of the weights.
- The surface other code relies on (the LoRA wrapper) is only `input_size`,
  `output_sizes`, `weight`, `bias` and `forward`; keep it that way.
- After `pack_for_onednn` (CPU fast path, once weights are final) the weight lives
  only in oneDNN's blocked layout; after `quantize` (`--quantization`) only in its
  quantized form (layers/quantization.py). Either way `weight` keeps its dtype and
  device but no data.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.quantization import QuantizedWeight, quantize, quantized_linear


def copy_checked(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into `param` (or a slice of it), converting dtype and
    device; a shape mismatch is an error rather than a silent broadcast."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"shape mismatch: the model expects {tuple(param.shape)}, the checkpoint has "
            f"{tuple(loaded_weight.shape)}"
        )
    param.copy_(loaded_weight)


def pack_onednn_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """A copy of `weight` [out, in] in oneDNN's pre-packed blocked layout (CPU)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int] = None) -> None:
    """Loader of every parameter that is not a fused slice (norms, embeddings)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shards, got shard {shard_id}")
    copy_checked(param.data, loaded_weight)


class Linear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        # Row offset of each fused slice inside the weight.
        self._offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self.weight = nn.Parameter(
            torch.empty(self.output_size, input_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._packed: Optional[torch.Tensor] = None
        self._quantized: Optional[QuantizedWeight] = None

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    def pack_for_onednn(self, batch_hint: int) -> None:
        """Move the weight into oneDNN's pre-packed layout (no second copy is kept); a
        quantized layer keeps its quantized weight."""
        if self._quantized is not None:
            return
        self._packed = pack_onednn_weight(self.weight, batch_hint)
        self.weight.data = self.weight.data.new_empty(0)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the weight however it is stored (dense, oneDNN-packed or quantized)."""
        if self._quantized is not None:
            return self._quantized.nbytes
        return self.output_size * self.input_size * self.weight.element_size()

    def quantize(self, method: str) -> None:
        """Keep the weight only in `method`'s quantized form (no full-precision copy)."""
        self._quantized = quantize(self.weight, method)
        self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, input_size] -> [num_tokens, output_size]
        if self._quantized is not None:
            return quantized_linear(x, self._quantized, self.bias)
        if self._packed is not None:
            return onednn_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int]) -> None:
        """Copy `loaded_weight` (a weight or a bias) into slice `shard_id`, or into the
        whole parameter when `shard_id` is None."""
        if shard_id is None:
            copy_checked(param.data, loaded_weight)
            return
        if not 0 <= shard_id < self.num_shards:
            raise ValueError(f"shard {shard_id} out of range for a layer with {self.num_shards} output slices")
        # Rows are dim 0 for both the weight [out, in] and the bias [out].
        target = param.data.narrow(0, self._offsets[shard_id], self.output_sizes[shard_id])
        copy_checked(target, loaded_weight)

    def extra_repr(self) -> str:
        return f"input_size={self.input_size}, output_sizes={self.output_sizes}, bias={self.bias is not None}"
