"""Megatron-style sharding of a layer across the tensor-parallel ranks: which rows or columns
of a full checkpoint tensor this rank keeps.

Semantics (world size W, rank r; every split even, checked at build time):
    column-parallel  y_r = x @ W[rows_r].T            output features split (qkv, gate|up):
                     each fused slice is split on its own, so rank r holds q_r | k_r | v_r.
    row-parallel     y = sum_r x[:, cols_r] @ W[:, cols_r].T + bias      input features split
                     (o, down): each rank's partial product is all-reduced, the bias added once.
    attention heads  query heads split evenly; KV heads split evenly when there are at least W
                     of them, else replicated: rank r keeps KV head r * kv // W, the one its query
                     heads attend to under grouped-query attention.
    vocabulary       embedding and LM head rows split in ceil(V / W) blocks (the last padded with
                     zero rows): the embedding all-reduces its masked lookups, the head all-gathers
                     its logits and drops the padding.

`Shard` is None at world size 1: every layer is then exactly the single-process layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vllm.config import hf_num_kv_heads
from vllm.core.kv_cache_utils import cdiv
from vllm.distributed.parallel_state import TensorParallelState, get_tp


@dataclass(frozen=True)
class Shard:
    """The part of a full linear layer one rank holds."""

    out_ranges: Optional[tuple[tuple[int, int], ...]] = None  # per fused slice: (first row, rows) of it
    in_range: Optional[tuple[int, int]] = None  # (first input feature, features): row-parallel

    @property
    def row_parallel(self) -> bool:
        return self.in_range is not None

    def rows(self, loaded: torch.Tensor, slice_index: int) -> torch.Tensor:
        """This rank's rows of fused slice `slice_index` of a checkpoint tensor ([out_i, ...])."""
        if self.out_ranges is None:
            return loaded
        start, size = self.out_ranges[slice_index]
        return loaded.narrow(0, start, size)

    def cols(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's input features of a checkpoint weight ([out, in])."""
        if self.in_range is None:
            return loaded
        return loaded.narrow(-1, *self.in_range)


def _even(total: int, tp: TensorParallelState, what: str) -> tuple[int, int]:
    if total % tp.world_size:
        raise ValueError(f"tensor_parallel_size={tp.world_size} must divide {what} ({total}).")
    size = total // tp.world_size
    return tp.rank * size, size


def column_shard(output_sizes: Sequence[int], what: str) -> Optional[Shard]:
    """Every fused slice split evenly by output features."""
    tp = get_tp()
    if tp.world_size == 1:
        return None
    return Shard(out_ranges=tuple(_even(size, tp, what) for size in output_sizes))


def row_shard(input_size: int, what: str) -> Optional[Shard]:
    tp = get_tp()
    if tp.world_size == 1:
        return None
    return Shard(in_range=_even(input_size, tp, what))


@dataclass(frozen=True)
class HeadShard:
    """This rank's attention heads: counts, and the shards of qkv_proj and o_proj."""

    num_heads: int
    num_kv_heads: int
    qkv: Optional[Shard]
    o: Optional[Shard]
    first_head: int = 0  # index of this rank's first query head (per-head parameters: sinks)


def head_shard(num_heads: int, num_kv_heads: int, head_size: int,
               tp: Optional[TensorParallelState] = None) -> HeadShard:
    """`tp`: this process's place (default) or another rank's, to check a config before starting ranks."""
    tp = tp or get_tp()
    if tp.world_size == 1:
        return HeadShard(num_heads, num_kv_heads, None, None)
    first, heads = _even(num_heads, tp, "the number of attention heads")
    if num_kv_heads >= tp.world_size:
        kv_first, kv_heads = _even(num_kv_heads, tp, "the number of key/value heads")
    elif tp.world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp.world_size} must be a multiple of the number of key/value "
                         f"heads ({num_kv_heads}) when it exceeds it.")
    else:
        kv_first, kv_heads = tp.rank * num_kv_heads // tp.world_size, 1
    q_rows = (first * head_size, heads * head_size)
    kv_rows = (kv_first * head_size, kv_heads * head_size)
    return HeadShard(heads, kv_heads, Shard(out_ranges=(q_rows, kv_rows, kv_rows)), Shard(in_range=q_rows), first)


def check_heads_split(hf_config, world_size: int) -> None:
    """A ValueError now, before any rank starts, when the attention heads cannot be split."""
    head_shard(hf_config.num_attention_heads, hf_num_kv_heads(hf_config), 1, TensorParallelState(0, world_size))


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """KV heads one rank's cache holds (the split `head_shard` makes)."""
    return max(1, num_kv_heads // world_size)


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """(first token id, rows) of this rank's block of the vocabulary; rows include padding."""
    tp = get_tp()
    rows = cdiv(vocab_size, tp.world_size)
    return tp.rank * rows, rows
