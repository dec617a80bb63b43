"""A "random model" that drives grammars the way the engine will: fill, mask, sample, accept.

Logits are seeded Gaussian noise plus a fixed preference for tokens that close strings,
objects and arrays (and for EOS), so free-form JSON ends in a few dozen tokens. The
preference only shapes the noise; every decision about what is allowed is the grammar's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from vllm.sampling_params import StructuredOutputsParams
from vllm.structured_output import StructuredOutputManager, apply_bitmask

CLOSE_BIAS = 4.0
WHITESPACE_BIAS = -3.0


def preference(tokenizer, vocab_size: int) -> torch.Tensor:
    bias = torch.zeros(vocab_size)
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if any(c in text for c in '"]}') or token_id == tokenizer.eos_token_id:
            bias[token_id] = CLOSE_BIAS
        elif text and not text.strip():
            bias[token_id] = WHITESPACE_BIAS
    return bias


def run_batch(
    manager: StructuredOutputManager,
    tokenizer,
    params: Sequence[Optional[StructuredOutputsParams]],
    seed: int,
    max_steps: int = 400,
) -> list[Optional[str]]:
    """Generate for a batch whose rows are constrained by `params` (None: unconstrained).

    Returns the text of each constrained row (the final EOS excluded). Asserts on the way
    that every sampled token is accepted, that unconstrained rows' logits are untouched
    bit for bit, that no special token but EOS is ever sampled in a constrained row, and
    that every grammar terminates within `max_steps`.
    """
    generator = torch.Generator().manual_seed(seed)
    bias = preference(tokenizer, manager.vocab_size)
    special = set(tokenizer.all_special_ids)
    grammars = [manager.grammar_for(p) if p is not None else None for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    # Larger than the batch, as the engine allocates it once for its largest batch.
    bitmask = manager.allocate_bitmask(len(params) + 3)
    for _ in range(max_steps):
        rows = [(i, g) for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
        if not rows:
            break
        manager.fill_bitmask(bitmask, rows)
        logits = torch.randn(len(params), manager.vocab_size, generator=generator) * 1.5 + bias
        before = logits.clone()
        apply_bitmask(logits, bitmask, [i for i, _ in rows])
        for i, g in enumerate(grammars):
            if g is None:
                assert torch.equal(logits[i], before[i]), f"unconstrained row {i} changed"
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1).tolist()
        for i, g in rows:
            token = tokens[i]
            assert g.accept_token(token), f"row {i}: sampled token {token} rejected"
            if not g.is_terminated():
                assert token not in special, f"row {i}: special token {token} allowed"
                outputs[i].append(token)
    unfinished = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
    assert not unfinished, f"rows {unfinished} did not terminate within {max_steps} steps"
    return [tokenizer.decode(out) if g is not None else None for out, g in zip(outputs, grammars)]
