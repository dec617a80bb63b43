"""`AttentionVariant`: what one attention layer adds to plain causal softmax attention.

Each backend (torch_ref, cpu_native, triton_backend) takes the layer's variant next to
`scale` and computes, for query token at position p of a sequence and key position k:

    s = scale * (q . k)
    s = soft_cap * tanh(s / soft_cap)            if soft_cap is set (Gemma 2)
    s = -inf  where k > p, or k <= p - sliding_window  (the window holds the
              `sliding_window` newest positions, the query's own included; as
              transformers' `kv_idx > q_idx - sliding_window`)
    out = sum_k softmax(s ++ [sink_h])[k] * v_k  (a sink is an extra logit per query
              head that takes probability mass and has no value: gpt-oss)

Invariant: `PLAIN` (every field None) is exactly the attention before variants existed;
backends keep their fast paths for it. The variant is fixed per layer at construction
and never changes per step, so compiled kernels may specialise on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, eq=False)
class AttentionVariant:
    sliding_window: Optional[int] = None  # positions a query sees, itself included
    soft_cap: Optional[float] = None  # attention logit soft-capping
    sinks: Optional[torch.Tensor] = None  # [num_heads] fp32-castable sink logits

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of positions, got {self.sliding_window}.")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"The attention soft cap must be positive, got {self.soft_cap}.")

    @property
    def is_plain(self) -> bool:
        return self.sliding_window is None and self.soft_cap is None and self.sinks is None

    @property
    def needs_scores(self) -> bool:
        """True when the scores must be materialised (SDPA cannot apply a soft cap or sinks)."""
        return self.soft_cap is not None or self.sinks is not None

    def first_visible(self, position: int) -> int:
        """The lowest key position the query at `position` attends to."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1)


PLAIN = AttentionVariant()
