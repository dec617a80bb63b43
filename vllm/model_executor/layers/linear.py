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
  `output_sizes`, `full_input_size`, `full_output_sizes`, `shard`, `weight`, `bias`,
  `forward_local`, `reduce` and `forward`; keep it that way.
- Under tensor parallelism (`shard`, layers/tensor_parallel.py) `input_size` and
  `output_sizes` are this rank's, `full_*` the checkpoint's; the loader cuts each
  checkpoint tensor to this rank's rows or columns as it copies it. A row-parallel layer's
  `forward_local` is a partial sum without the bias; `reduce` all-reduces it and adds the
  bias, so an adapter's delta added in between is summed with it in the same all-reduce.
- After `pack_for_onednn` (CPU fast path, once weights are final) the weight lives
  only in oneDNN's blocked layout; after `quantize` (`--quantization`) only in its
  quantized form (layers/quantization.py). Either way `weight` keeps its dtype and
  device but no data.
- A GGUF checkpoint hands `weight_loader` `QuantizedWeight`s, one per output slice. Once
  all are in, slices of one format are stacked into a single weight (one kernel call, and the
  native decoder layer takes it); slices of different formats (e.g. Q4_K and Q6_K in a Q4_K_M
  file) are kept apart and the forward concatenates their outputs. `quantize` makes a single
  one covering every row.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from vllm.distributed.parallel_state import all_reduce
from vllm.model_executor.layers.dense_gemv import dense_linear, onednn_linear
from vllm.model_executor.layers.quantization import QuantizedWeight, quantize, quantized_linear, stack_rows, tile
from vllm.model_executor.layers.tensor_parallel import Shard


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
        shard: Optional[Shard] = None,
    ):
        super().__init__()
        self.full_input_size = input_size
        self.full_output_sizes = list(output_sizes)
        self.shard = shard
        if shard is not None and shard.out_ranges is not None:
            output_sizes = [size for _, size in shard.out_ranges]
        if shard is not None and shard.in_range is not None:
            input_size = shard.in_range[1]
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
        # Empty: dense. Else one covering all rows, or one per output slice (GGUF slices of mixed formats).
        self._quantized: list[Optional[QuantizedWeight]] = []

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    def pack_for_onednn(self, batch_hint: int) -> None:
        """Move the weight into oneDNN's pre-packed layout (no second copy is kept); a
        quantized layer keeps its quantized weight."""
        if self._quantized:
            return
        self._packed = pack_onednn_weight(self.weight, batch_hint)
        self.weight.data = self.weight.data.new_empty(0)

    def quantized_weights(self) -> list[QuantizedWeight]:
        """The weight's quantized form (one, or one per output slice); empty while dense."""
        return [q for q in self._quantized if q is not None]

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the weight however it is stored (dense, oneDNN-packed or quantized)."""
        if self._quantized:
            return sum(q.nbytes for q in self._quantized)
        return self.output_size * self.input_size * self.weight.element_size()

    def quantize(self, method: str) -> None:
        """Keep the weight only in `method`'s quantized form (no full-precision copy)."""
        self._quantized = [tile(quantize(self.weight, method))]
        self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, input_size] -> [num_tokens, output_size]
        return self.reduce(self.forward_local(x))

    @property
    def _row_parallel(self) -> bool:
        return self.shard is not None and self.shard.row_parallel

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product: the output, or for a row-parallel layer a partial sum without bias."""
        bias = None if self._row_parallel else self.bias
        if len(self._quantized) == 1:
            return quantized_linear(x, self._quantized[0], bias)
        if self._quantized:  # one per output slice
            out = torch.cat([quantized_linear(x, q, None) for q in self._quantized], dim=-1)
            return out if bias is None else out.add_(bias)
        if self._packed is not None:
            return onednn_linear(x, self._packed, bias)
        return dense_linear(x, self.weight, bias)  # few rows on the CPU: the native kernels

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from `forward_local`'s (the identity unless row-parallel)."""
        if not self._row_parallel:
            return y
        all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int]) -> None:
        """Copy `loaded_weight` (a weight or a bias) into slice `shard_id`, or into the
        whole parameter when `shard_id` is None; under tensor parallelism only this rank's part."""
        if isinstance(loaded_weight, QuantizedWeight):
            self._load_quantized(param, loaded_weight, shard_id)
            return
        if self.shard is not None:
            loaded_weight = self._rank_part(param, loaded_weight, shard_id)
        if shard_id is None:
            copy_checked(param.data, loaded_weight)
            return
        if not 0 <= shard_id < self.num_shards:
            raise ValueError(f"shard {shard_id} out of range for a layer with {self.num_shards} output slices")
        # Rows are dim 0 for both the weight [out, in] and the bias [out].
        target = param.data.narrow(0, self._offsets[shard_id], self.output_sizes[shard_id])
        copy_checked(target, loaded_weight)

    def _load_quantized(self, param: nn.Parameter, weight: QuantizedWeight, shard_id: Optional[int]) -> None:
        """Keep a slice stored quantized (GGUF) as it is; the dense weight goes once every slice is in."""
        if param is not self.weight or self.shard is not None:
            raise ValueError("quantized checkpoint tensors load only into an unsharded layer's weight "
                             "(tensor_parallel_size 1)")
        slices = 1 if shard_id is None else self.num_shards
        if not self._quantized:
            self._quantized = [None] * slices
        if len(self._quantized) != slices or not 0 <= (shard_id or 0) < slices:
            raise ValueError(f"slice {shard_id} does not fit a layer with {self.num_shards} output slices "
                             "stored as separate quantized tensors")
        rows = self.output_size if shard_id is None else self.output_sizes[shard_id]
        if (weight.out_features, weight.in_features) != (rows, self.input_size):
            raise ValueError(f"shape mismatch: the model expects {(rows, self.input_size)}, the checkpoint has "
                             f"{(weight.out_features, weight.in_features)}")
        self._quantized[shard_id or 0] = weight
        if all(q is not None for q in self._quantized):
            stacked = stack_rows(self._quantized)
            self._quantized = [tile(q) for q in (self._quantized if stacked is None else [stacked])]
            self.weight.data = self.weight.data.new_empty(0)

    def _rank_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int]) -> torch.Tensor:
        """This rank's rows (per fused slice) and, for the weight, input columns of a checkpoint tensor."""
        if param is self.weight:
            loaded = self.shard.cols(loaded)
        if shard_id is not None:
            return self.shard.rows(loaded, shard_id)
        if self.shard.out_ranges is None:
            return loaded
        if loaded.shape[0] != sum(self.full_output_sizes):
            raise ValueError(f"shape mismatch: the model expects {sum(self.full_output_sizes)} rows, the "
                             f"checkpoint has {loaded.shape[0]}")
        # A fused tensor stored whole: cut each slice's rows, keep slice order.
        parts = loaded.split(self.full_output_sizes, dim=0)
        return torch.cat([self.shard.rows(part, i) for i, part in enumerate(parts)], dim=0)

    def extra_repr(self) -> str:
        tp = "" if self.shard is None else f", {'row' if self.shard.row_parallel else 'column'}-parallel"
        return f"input_size={self.input_size}, output_sizes={self.output_sizes}, bias={self.bias is not None}{tp}"
