"""Per-step adapter-mapping metadata shared by every LoRA layer (punica's role).

The model runner hands in `token_lora_mapping` (one slot index per token, -1 for
tokens that use no adapter: base requests, and aLoRA tokens before the invocation).
From it we derive, once per step, everything the LoRA ops need:

- `runs`: for the torch op, maximal runs `(slot, start, end)` of consecutive tokens
  with the same slot (the runner orders the batch by slot, so there are few), used
  as views with no gather; or, when the mapping is fragmented, `groups`: `(slot,
  rows)` per active slot for a gather / scatter-add.
- SGMV segments for the Triton op: tokens ordered by slot (`sorted_token_ids`), with
  one segment `(seg_slots[s], seg_starts[s], seg_lens[s])` per active slot. Tokens
  with -1 are not in any segment, so they cost nothing.

Invariant: layers never look at requests or positions; "-1 means no adapter" is all
they know, which is what makes aLoRA free in the layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from vllm.platforms import use_triton_kernels


@dataclass
class LoRAKernelMeta:
    num_tokens: int = 0
    token_lora_mapping: Optional[torch.Tensor] = None  # [num_tokens] int32 (view of a persistent buffer)
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end)
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    sorted_token_ids: Optional[torch.Tensor] = None  # [num_adapted_tokens] int64
    seg_slots: Optional[torch.Tensor] = None  # [num_segments] int32
    seg_starts: Optional[torch.Tensor] = None  # [num_segments] int32, offsets into sorted_token_ids
    seg_lens: Optional[torch.Tensor] = None  # [num_segments] int32
    max_seg_len: int = 0
    # A CUDA-graph step: the ops run per token over the whole padded mapping buffer (BGMV, or
    # the torch op's masked form), whatever it holds, so a replay applies this step's adapters.
    graph: bool = False

    @property
    def has_lora(self) -> bool:
        return bool(self.runs or self.groups) or self.graph

    # Derived once per step (a step's meta is not changed once PunicaWrapper.update has set it),
    # read by every LoRA layer's call on the CPU's native path.
    @functools.cached_property
    def flat_runs(self) -> list[int]:
        """`runs` flat: slot, start, end, slot, start, end, ..."""
        return [value for run in self.runs for value in run]

    @functools.cached_property
    def run_tokens(self) -> int:
        """Tokens in `runs`."""
        return sum(end - start for _, start, end in self.runs)


# Beyond this many runs per adapter, one gather per adapter is cheaper than many views.
_MAX_RUNS_PER_SLOT = 4


def _runs(mapping: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of equal non-negative slots: [(slot, start, end)]."""
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(mapping)) + 1, [mapping.shape[0]]))
    return [(int(mapping[a]), int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if mapping[a] >= 0]


class PunicaWrapper:
    """Owns the persistent `token_lora_mapping` buffer and the per-step metadata."""

    def __init__(self, max_num_tokens: int, device: torch.device):
        self.device = device
        self.token_lora_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.meta = LoRAKernelMeta()
        if use_triton_kernels(device):
            from vllm.lora.ops import triton_ops

            self._add_lora = triton_ops.add_lora
        else:
            from vllm.lora.ops import torch_ops

            self._add_lora = torch_ops.add_lora

    def update(self, mapping: np.ndarray, graph_size: Optional[int] = None) -> None:
        """mapping: [num_tokens] int, slot per token or -1. `graph_size`: a CUDA-graph step padded
        to that many tokens (vllm/worker/cuda_graph.py): no per-step metadata beyond the buffer."""
        n = int(mapping.shape[0])
        mapping_t = torch.from_numpy(np.ascontiguousarray(mapping, dtype=np.int32))
        self.token_lora_mapping[:n].copy_(mapping_t, non_blocking=True)
        self.token_lora_mapping[n:].fill_(-1)
        if graph_size is not None:
            self.meta = LoRAKernelMeta(num_tokens=graph_size, token_lora_mapping=self.token_lora_mapping[:graph_size],
                                       graph=True)
            return
        meta = LoRAKernelMeta(num_tokens=n, token_lora_mapping=self.token_lora_mapping[:n])
        adapted = np.flatnonzero(mapping >= 0)
        if adapted.size:
            order = adapted[np.argsort(mapping[adapted], kind="stable")]
            slots, starts, lens = np.unique(mapping[order], return_index=True, return_counts=True)
            runs = _runs(mapping)
            if len(runs) <= _MAX_RUNS_PER_SLOT * len(slots):
                meta.runs = runs
            else:
                meta.groups = [(slot, torch.from_numpy(order[start : start + length]).to(self.device))
                               for slot, start, length in zip(slots.tolist(), starts.tolist(), lens.tolist())]
            meta.sorted_token_ids = torch.from_numpy(order.astype(np.int64)).to(self.device)
            meta.seg_slots = torch.from_numpy(slots.astype(np.int32)).to(self.device)
            meta.seg_starts = torch.from_numpy(starts.astype(np.int32)).to(self.device)
            meta.seg_lens = torch.from_numpy(lens.astype(np.int32)).to(self.device)
            meta.max_seg_len = int(lens.max())
        self.meta = meta

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: Sequence[torch.Tensor],
        lora_b: Sequence[torch.Tensor],
        output_slices: Sequence[int],
    ) -> None:
        if self.meta.has_lora:
            self._add_lora(y, x, lora_a, lora_b, output_slices, self.meta)
