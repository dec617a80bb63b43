"""`LinearWithLoRA`: a base linear layer plus stacked adapter weights in `max_loras` slots.

Per fused slice i (q/k/v, or gate/up, or the single slice of o/down):
    lora_a[i]: [max_loras, max_rank, input_size]
    lora_b[i]: [max_loras, output_sizes[i], max_rank]   (PEFT scaling folded in)
A slot holds zeros wherever its adapter has no weights (untargeted slice, rank
below max_rank), so the op needs no per-slot shape logic.

Off the Triton path, the slices are stored stacked as one: A of every slice
concatenated ([max_loras, S * max_rank, input_size]) and B block-diagonal
([max_loras, sum(output_sizes), S * max_rank]). That is the same function (the zero
blocks keep slices apart) in two matmuls per adapter run instead of two per slice,
which matters on the CPU where per-op cost dominates small decode batches.

The layer knows nothing of requests or aLoRA: the shared punica wrapper says which
slot each token uses, and -1 tokens keep exactly the base output.

Under tensor parallelism the slots hold this rank's part of each adapter, cut as the base
layer is (layers/tensor_parallel.py): a column-parallel layer keeps all of A and its rows of
B; a row-parallel layer keeps its input columns of A and all of B, and its delta
`(x_r @ A_r.T) @ B.T` joins the base layer's partial sum before the one all-reduce:
the sum over ranks is `(x @ A.T) @ B.T` (the shrink all-reduced before the expand, folded
into the base layer's reduction).

The slots may hold another dtype than the base layer (`--lora-dtype`): then the op runs on
a copy of x in that dtype into a zeroed buffer, added to the base output in its dtype, so
the kernels always see one dtype.

On the CPU, where the native LoRA kernel is built (vllm/lora/ops/cpu_native.py), the layer
stores B transposed (`lora_b_t` [max_loras, S * max_rank, sum(output_sizes)]; `lora_b` is its
transposed view, so `set_lora` and the punica op see the usual layout in the same memory) and
each slice's block of it (`_blocks`): steps whose adapted tokens form runs take that kernel, one
call per layer; other steps the punica op.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.lora.lora_model import LoRALayerWeights
from vllm.lora.ops import cpu_native
from vllm.lora.punica import PunicaWrapper
from vllm.platforms import use_triton_kernels


class LinearWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module, max_loras: int, max_rank: int, punica: PunicaWrapper,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.base_layer = base_layer
        self.punica = punica
        weight = base_layer.weight
        self.lora_dtype = dtype or weight.dtype
        self.input_size = base_layer.input_size
        self.output_sizes = tuple(base_layer.output_sizes)
        self.max_rank = max_rank
        self.stacked = not use_triton_kernels(weight.device) and len(self.output_sizes) > 1
        # Column offset of each slice's output, and width of the (stacked) rank.
        self._out_offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        num_a = 1 if self.stacked else len(self.output_sizes)
        rank_width = max_rank * len(self.output_sizes) if self.stacked else max_rank
        b_sizes = [sum(self.output_sizes)] if self.stacked else list(self.output_sizes)
        self.lora_a = [
            torch.zeros(max_loras, rank_width, self.input_size, dtype=self.lora_dtype, device=weight.device)
            for _ in range(num_a)
        ]
        # Where the native CPU op runs, B is stored transposed (`lora_b_t`) and `lora_b` is a view of
        # it: the torch op reads the same memory (its `b[slot].T` is lora_b_t[slot] itself).
        self.lora_b_t: Optional[torch.Tensor] = None
        if not use_triton_kernels(weight.device) and cpu_native.available(weight.device, self.lora_dtype):
            self.lora_b_t = torch.zeros(max_loras, rank_width, sum(b_sizes), dtype=self.lora_dtype,
                                        device=weight.device)
            self.lora_b = [self.lora_b_t.transpose(1, 2)]
        else:
            self.lora_b = [torch.zeros(max_loras, size, rank_width, dtype=self.lora_dtype, device=weight.device)
                           for size in b_sizes]
        self._op_slices = tuple(b_sizes)
        # The native op's blocks of B^T (flat column start, column count, rank start, rank count per slice).
        ranks = [max_rank * i if self.stacked else 0 for i in range(len(self.output_sizes))]
        self._blocks = [v for off, size, r0 in zip(self._out_offsets, self.output_sizes, ranks)
                        for v in (off, size, r0, max_rank)]

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def _slice_views(self, slot: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where slice i's A [max_rank, in] and B [out_i, max_rank] live for `slot`."""
        if not self.stacked:
            return self.lora_a[i][slot], self.lora_b[i][slot]
        ranks = slice(i * self.max_rank, (i + 1) * self.max_rank)
        rows = slice(self._out_offsets[i], self._out_offsets[i] + self.output_sizes[i])
        return self.lora_a[0][slot, ranks], self.lora_b[0][slot, rows, ranks]

    def set_lora(self, slot: int, weights: Optional[LoRALayerWeights]) -> None:
        """Load an adapter's weights for this layer into `slot` (None: the adapter skips it)."""
        for a in self.lora_a:
            a[slot].zero_()
        for b in self.lora_b:
            b[slot].zero_()
        if weights is None:
            return
        shard = self.base_layer.shard
        for i in range(len(self.output_sizes)):
            if weights.lora_a[i] is None:
                continue
            a, b = weights.lora_a[i], weights.lora_b[i]  # [r, full in], [full out_i, r]
            if shard is not None:
                a, b = shard.cols(a), shard.rows(b, i)
            rank = a.shape[0]
            a_view, b_view = self._slice_views(slot, i)
            a_view[:rank].copy_(a, non_blocking=True)
            b_view[:, :rank].copy_(b, non_blocking=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer.forward_local(x)  # [num_tokens, sum(output_sizes)]
        if self.lora_dtype == y.dtype:
            self._add_lora(y, x)
        elif self.punica.meta.has_lora:
            delta = torch.zeros(y.shape, dtype=self.lora_dtype, device=y.device)
            self._add_lora(delta, x.to(self.lora_dtype))
            y.add_(delta.to(y.dtype))
        return self.base_layer.reduce(y)

    def _add_lora(self, y: torch.Tensor, x: torch.Tensor) -> None:
        meta = self.punica.meta
        if (self.lora_b_t is not None and cpu_native.runs_native(meta, y.dtype) and x.dim() == 2 and x.stride(1) == 1
                and y.stride(1) == 1):
            cpu_native.add_lora_runs(y, x, self.lora_a[0], self.lora_b_t, self._blocks, meta)
        else:
            self.punica.add_lora(y, x, self.lora_a, self.lora_b, self._op_slices)
