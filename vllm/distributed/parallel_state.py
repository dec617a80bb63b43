"""This process's place in the tensor-parallel group, and the collectives the sharded layers use.

What it owns: one module-level `TensorParallelState` per process (rank, world size, whether a
torch.distributed group is up). Layers read it once, when they are built, to pick their shard;
the forward pass calls `all_reduce` / `all_gather`, which are the identity at world size 1, so a
single-process engine never touches torch.distributed.

Invariants:
- Every rank builds the same model with the same config; only the shard of each sharded layer
  differs, so every rank issues the same collectives in the same order each step.
- `init_tensor_parallel` is called once per process before the model is built and undone by
  `destroy_tensor_parallel` (the engine process may build several engines in turn, as tests do).
- The backend is gloo on the CPU and NCCL on CUDA; collectives time out after `timeout_s`, so
  a hung rank fails the step instead of freezing the engine (a rank that exits fails it at once).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
# How long the ranks may take to meet at start-up (spawning and importing), apart from the
# collectives' timeout, which may be much shorter.
RENDEZVOUS_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TensorParallelState:
    rank: int = 0
    world_size: int = 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs in the engine process: it schedules, and its samples are the step's."""
        return self.rank == 0


_STATE = TensorParallelState()


def get_tp() -> TensorParallelState:
    return _STATE


def init_tensor_parallel(rank: int, world_size: int, address: tuple[str, int], device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group of `world_size` ranks meeting at `address` (host, port; rank 0 listens)."""
    global _STATE
    if _STATE.world_size != 1 or dist.is_initialized():
        raise RuntimeError("this process is already in a tensor-parallel group: another engine with "
                           "tensor_parallel_size > 1 is alive here; shut it down first "
                           "(llm.llm_engine.engine_core.shutdown()).")
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore(address[0], address[1], world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _STATE = TensorParallelState(rank, world_size)


def destroy_tensor_parallel() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallelState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (the identity at world size 1)."""
    if _STATE.world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order (`x` itself at world size 1)."""
    if _STATE.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
