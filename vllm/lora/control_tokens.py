"""Control-token routing for adapters embedded in the checkpoint (Granite Switch).

Semantics (the format's switch rule, computed exactly, with no limit on control
tokens per request):
    adapter(p) = adapter index of the last control token at a position <= p of the
                 sequence (prompt and generated tokens alike), or 0 (base) if none;
                 `<|base_reset|>` is a control token of adapter 0.
So a control token's own position is already adapted, and a control token sampled
mid-answer switches every later token.

`ControlTokenRouter` turns that rule into LoRA slots: embedded adapter `a` lives in
slot `a - 1` and base is -1, the same per-token mapping PEFT adapters use. It is an
integer scan over token ids: a lookup table `[vocab]` (-1 for ordinary ids), and per
step one `maximum.accumulate` over the flat batch; the adapter in effect before a
request's first scheduled token (`carry`) comes from an incremental scan of the tokens
it already computed, kept in `ScanState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class ScanState:
    """How far a request's tokens were scanned, and the adapter in effect after them."""

    scanned: int = 0
    adapter: int = 0


class ControlTokenRouter:
    def __init__(self, vocab_size: int, control_to_adapter: dict[int, int]):
        self.table = np.full(vocab_size, -1, dtype=np.int32)  # token id -> adapter index, -1: not a control
        for token, adapter in control_to_adapter.items():
            self.table[token] = adapter
        self.control_ids = frozenset(control_to_adapter)

    def adapter_before(self, state: ScanState, token_ids: Sequence[int], position: int) -> int:
        """The adapter in effect at `position - 1` (0 at position 0), scanning only the
        tokens not scanned before; a position behind the scan (recompute) rescans."""
        if position < state.scanned:
            state.scanned, state.adapter = 0, 0
        if position > state.scanned:
            adapters = self.table[np.asarray(token_ids[state.scanned : position], dtype=np.int64)]
            controls = np.flatnonzero(adapters >= 0)
            if controls.size:
                state.adapter = int(adapters[controls[-1]])
            state.scanned = position
        return state.adapter

    def route(self, input_ids: np.ndarray, query_start_loc: np.ndarray, carry: np.ndarray) -> np.ndarray:
        """Adapter index of every token of a flat step batch.

        input_ids: [T] token ids; query_start_loc: [B + 1] offsets of each request's
        tokens (each request has at least one); carry: [B] adapter in effect before each
        request's first token. Returns [T] int32."""
        adapters = self.table[input_ids]  # [T]
        firsts = query_start_loc[:-1]
        # A request's first token without a control takes the carried adapter, so the
        # running "last control" never crosses into another request.
        adapters[firsts] = np.where(adapters[firsts] >= 0, adapters[firsts], carry)
        last = np.maximum.accumulate(np.where(adapters >= 0, np.arange(adapters.size), -1))
        return adapters[last]

    @staticmethod
    def slots(adapters: np.ndarray) -> np.ndarray:
        """Adapter indices -> LoRA slots (embedded adapter a is slot a - 1, base -1)."""
        return (adapters - 1).astype(np.int32)
