"""Applying a packed next-token bitmask to logits: disallowed tokens become -inf.

What it owns: the one dispatch point for the masking op, and its torch reference.

Layout (xgrammar's): `bitmask` is int32 of shape (rows, ceil(V / 32)); bit `j % 32` of word
`j // 32` in a row is 1 when token `j` is allowed. Bitmask row r belongs to logits row r;
the bitmask may have more rows than the logits (allocated once for the largest batch).

Invariants:
- Only the rows in `row_indices` change; every other row is bit-identical afterwards.
- In a masked row, allowed logits keep their exact values; disallowed ones become -inf.
- Logits columns beyond the bitmask's coverage (a vocabulary wider than the grammar's) are
  disallowed in masked rows: the grammar cannot have produced them.
- The bitmask may live on the CPU (where xgrammar fills it); it is copied to the logits'
  device here, synchronously, so the caller may refill it right after this returns.

Dispatch: xgrammar's C++ kernel on CPU (float32/bfloat16/float16), xgrammar's Triton kernel
where `vllm.platforms.use_triton_kernels` says so, the torch reference everywhere else
(other devices and dtypes, or VLLM_USE_TORCH_REFERENCE_OPS).
"""

from __future__ import annotations

from typing import Sequence

import torch
import xgrammar as xgr

from vllm.platforms import use_triton_kernels

_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: Sequence[int]) -> None:
    """Set `logits[r, t] = -inf` for every row r in `row_indices` and disallowed token t."""
    rows = sorted({int(r) for r in row_indices})
    if not rows:
        return
    _check(logits, bitmask, rows)
    # Only the rows up to the last masked one are needed on the logits' device.
    bitmask = bitmask[: rows[-1] + 1].to(logits.device)
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.device.type == "cpu" and logits.dtype in _CPU_KERNEL_DTYPES:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows, backend="cpu")
    elif use_triton_kernels(logits.device):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows, backend="triton")
    else:
        apply_bitmask_reference(logits, bitmask, rows)
        return
    if logits.shape[-1] > width:
        logits[rows, width:] = float("-inf")


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: Sequence[int]) -> None:
    """The torch implementation (and test oracle) of `apply_bitmask`, on any device."""
    rows = torch.as_tensor(list(row_indices), dtype=torch.long, device=logits.device)
    if rows.numel() == 0:
        return
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    packed = bitmask.to(logits.device).index_select(0, rows)  # (R, W) int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # `>>` on int32 is arithmetic, so negative words still give the right low bit.
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :width].bool()
    disallowed = torch.ones(rows.numel(), logits.shape[-1], dtype=torch.bool, device=logits.device)
    disallowed[:, :width] = ~allowed
    masked = logits.index_select(0, rows).masked_fill(disallowed, float("-inf"))
    logits.index_copy_(0, rows, masked)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (rows, vocab), got shape {tuple(logits.shape)}.")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} of shape {tuple(bitmask.shape)}.")
    limit = min(logits.shape[0], bitmask.shape[0])
    if rows[0] < 0 or rows[-1] >= limit:
        raise IndexError(
            f"row indices {rows} out of range for {logits.shape[0]} logits rows and {bitmask.shape[0]} bitmask rows."
        )
