"""The engine's entry point to structured outputs: validation, per-request grammars, bitmasks.

What it owns: the xgrammar `TokenizerInfo` (built once per engine), the compile cache, and
filling the next-token bitmask of a batch.

How the engine uses it:
- The input processor calls `validate(params)` when it admits a request (HTTP thread or
  `LLM.generate`), so an invalid schema/regex/grammar becomes a `ValueError` (HTTP 400)
  and never reaches the engine loop. It also warms the cache for `grammar_for`.
- The scheduler calls `grammar_for(params)` once per request and keeps the returned
  `RequestGrammar` for the request's lifetime (preemption included).
- Before each model step the scheduler calls `fill_bitmask(bitmask, [(row, grammar), ...])`
  for the rows that will sample; the model runner then calls
  `vllm.structured_output.bitmask.apply_bitmask(logits, bitmask, rows)`; after sampling the
  scheduler calls `grammar.accept_token(token)` and finishes the request once
  `grammar.is_terminated()`.

Invariants:
- Bitmask width covers the model's vocabulary (`vocab_size`, the logits width), which may
  exceed the tokenizer's: ids without a token are never allowed in a constrained row.
- Special tokens (the tokenizer's added tokens marked special) are never allowed inside a
  constrained output, except the stop tokens where the grammar may end. Without this,
  xgrammar treats e.g. `<|start_of_role|>` as its literal text, which the detokenizer then
  drops, and the returned text would no longer match the grammar.
- The stop tokens are explicit: the tokenizer's EOS unless the caller passes its own.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import xgrammar as xgr

from vllm.sampling_params import StructuredOutputsParams
from vllm.structured_output.compiler import GrammarCache
from vllm.structured_output.grammar import RequestGrammar, fill_stop_only

# From this many constrained rows on, bitmask rows are filled on a thread pool.
PARALLEL_FILL_MIN_ROWS = 128


def build_tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer`, padded to the model's `vocab_size`."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    # xgrammar detects the vocabulary's encoding (byte-level, byte-fallback, raw) from the
    # HF tokenizer; we keep that and rebuild the vocabulary with special tokens blanked,
    # which xgrammar then treats as special (never part of the text).
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    for token_id in _special_token_ids(tokenizer):
        if token_id < vocab_size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=detected.add_prefix_space,
    )


def _special_token_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


class StructuredOutputManager:
    """Compiles (with a cache) and hands out grammars; fills batch bitmasks.

    `validate` and `grammar_for` are thread-safe; `fill_bitmask` and the returned
    `RequestGrammar`s belong to the engine thread.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        *,
        stop_token_ids: Optional[Iterable[int]] = None,
        max_cached_grammars: int = 256,
        max_compile_threads: int = 8,
    ) -> None:
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("The tokenizer has no eos_token_id; pass stop_token_ids for structured outputs.")
            stop_token_ids = [tokenizer.eos_token_id]
        stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        if not stop_token_ids or not all(0 <= t < vocab_size for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-empty ids in [0, {vocab_size}), got {stop_token_ids}.")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # xgrammar's own cache is off: ours is keyed by the request spec and bounded.
        compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_compile_threads, cache_enabled=False)
        self._cache = GrammarCache(compiler, max_entries=max_cached_grammars)
        # A row's mask is mostly a copy of a precomputed one (microseconds), so small batches
        # fill fastest on one thread; large ones use a pool (half the cores), as vLLM does.
        self._serial_filler = xgr.BatchGrammarMatcher(max_threads=1)
        self._parallel_filler = xgr.BatchGrammarMatcher()

    # -- admission and per-request state ------------------------------------------------

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError (naming the problem) if `params` cannot be compiled."""
        self._cache.get(params)

    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh grammar state for one request (the compiled grammar is shared)."""
        return RequestGrammar(self._cache.get(params))

    @property
    def num_compiles(self) -> int:
        """How many specs were compiled (cache misses) since the manager was built."""
        return self._cache.misses

    @property
    def num_cache_hits(self) -> int:
        return self._cache.hits

    # -- bitmasks -------------------------------------------------------------------------

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU int32 bitmask of shape (num_rows, ceil(vocab_size / 32)), all allowed.

        Allocate it once for the largest batch and reuse it: `fill_bitmask` rewrites it.
        """
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, rows: Sequence[tuple[int, RequestGrammar]]) -> None:
        """Fill `bitmask[row]` for each listed (row, grammar); every other row allows everything."""
        # numpy's fill is single-threaded: torch's OpenMP fill of this small tensor can take
        # milliseconds when the cores are busy (measured on a 2-core machine).
        bitmask.numpy().fill(-1)
        live_rows, live_matchers = [], []
        for row, grammar in rows:
            if grammar.is_terminated():
                fill_stop_only(bitmask, row, self.stop_token_ids)
            else:
                live_rows.append(row)
                live_matchers.append(grammar.matcher)
        if live_rows:
            filler = self._parallel_filler if len(live_rows) >= PARALLEL_FILL_MIN_ROWS else self._serial_filler
            filler.batch_fill_next_token_bitmask(live_matchers, bitmask, live_rows)
