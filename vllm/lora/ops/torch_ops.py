"""Torch reference of the multi-LoRA op (the CPU path and the oracle of the Triton
kernels).

Semantics:
    for every token t with slot s = token_lora_mapping[t] >= 0, and every slice i:
        y[t, off_i : off_i + n_i] += (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T
    rows with slot -1 are not touched (bit-for-bit; a graph step's masked form adds 0 to them). `off_i` is the running sum of
    `output_slices`; the adapter's scaling is already folded into lora_b.

Shapes: x [T, in]; y [T, sum(output_slices)]; lora_a[i] [max_loras, max_rank, in];
lora_b[i] [max_loras, n_i, max_rank]. Slots an adapter does not target hold zeros.
Each run of consecutive tokens with one adapter costs two matmuls per slice on views
of x and y; a fragmented mapping is handled per adapter with a gather and a
scatter-add instead; a CUDA-graph step (`meta.graph`) runs every slot over every row,
masked by the mapping buffer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from vllm.lora.punica import LoRAKernelMeta


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    output_slices: Sequence[int],
    meta: LoRAKernelMeta,
) -> None:
    offsets = [0]
    for size in output_slices:
        offsets.append(offsets[-1] + size)
    if meta.graph:
        _add_lora_masked(y, x, lora_a, lora_b, meta.token_lora_mapping)
        return
    for slot, start, end in meta.runs:
        xs = x[start:end]
        for i, (a, b) in enumerate(zip(lora_a, lora_b)):
            y[start:end, offsets[i] : offsets[i + 1]].addmm_(xs @ a[slot].T, b[slot].T)
    for slot, rows in meta.groups:
        xs = x.index_select(0, rows)
        deltas = [(xs @ a[slot].T) @ b[slot].T for a, b in zip(lora_a, lora_b)]
        y.index_add_(0, rows, deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=1))


def _add_lora_masked(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                     mapping: torch.Tensor) -> None:
    """Every slot over every row, kept where the row's mapping names the slot: fixed shapes and
    no host sync, so it reads whatever the mapping buffer holds when it runs (a graph step)."""
    for slot in range(lora_a[0].shape[0]):
        keep = (mapping == slot).unsqueeze(1).to(y.dtype)  # [num_tokens, 1]
        delta = torch.cat([(x @ a[slot].T) @ b[slot].T for a, b in zip(lora_a, lora_b)], dim=1)
        y.addcmul_(delta, keep)
