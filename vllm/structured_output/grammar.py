"""One request's grammar state: an xgrammar matcher over a shared compiled grammar.

What it owns: the position of one request inside its grammar, advanced by every token the
request samples, and that request's row of the next-token bitmask.

Invariants and contract with the scheduler:
- The state covers exactly the tokens accepted so far. Preemption does not touch it: a
  preempted request recomputes its KV cache, not its output, so the scheduler keeps the
  same `RequestGrammar` and must not accept the output tokens again.
- The bitmask allows a stop token only where the grammar is complete. Accepting that stop
  token terminates the grammar; the scheduler then finishes the request (finish reason
  "stop", the stop token is not part of the text). This holds even with `ignore_eos`, since
  nothing can follow a terminated grammar.
- `accept_token` returning False means the sampled token violates the grammar (only
  possible if the bitmask was not applied to that row, or the caller's own masks such as
  `allowed_token_ids` left no allowed token). The state is unchanged; the caller must
  finish the request with an error rather than keep generating unconstrained text.
- A terminated grammar's row allows only the stop tokens, so a request that is not yet
  finished ends at its next step instead of producing text outside the grammar.
"""

from __future__ import annotations

import torch
import xgrammar as xgr


class RequestGrammar:
    """The grammar state of one request. Not thread-safe: only the engine thread uses it."""

    __slots__ = ("_matcher", "_stop_token_ids")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop_token_ids = tuple(compiled.tokenizer_info.stop_token_ids)

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        """The xgrammar matcher, for batched bitmask filling by the manager."""
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (state unchanged)."""
        return self._matcher.accept_token(int(token_id))

    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token has been accepted."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token may now follow)."""
        return self._matcher.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 bitmask)."""
        if self._matcher.is_terminated():
            fill_stop_only(bitmask, row, self._stop_token_ids)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


def fill_stop_only(bitmask: torch.Tensor, row: int, stop_token_ids: tuple[int, ...]) -> None:
    """Make `bitmask[row]` allow only `stop_token_ids`."""
    bitmask[row].zero_()
    for token_id in stop_token_ids:
        word, bit = divmod(token_id, 32)
        # int32 words: bit 31 is the sign bit, so set it through a wrapped value.
        value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
