"""Token embedding and LM head.

`VocabEmbedding` maps token ids to rows of a `[vocab_size, hidden_size]` table.
`LMHead` projects final hidden states onto the vocabulary. With tied embeddings the
head shares the embedding's Parameter (one tensor in memory, loaded once from
`model.embed_tokens.weight`; a checkpoint's `lm_head.weight` is then ignored).

The head returns logits in the model dtype; models' `compute_logits` turns them into
float32 so sampling and logprobs do not depend on the model dtype's rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.linear import default_weight_loader, onednn_linear, pack_onednn_weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden_size]
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}"


class LMHead(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tied_embedding: Optional[VocabEmbedding] = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tied_embedding is not None
        self._packed: Optional[torch.Tensor] = None
        if self.tied:
            # The same Parameter object: named_parameters() lists it once, under the
            # embedding's name, so the loader fills it once.
            self.weight = tied_embedding.weight
            return
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader

    def pack_for_onednn(self, batch_hint: int) -> None:
        """CPU fast path: a pre-packed copy of the weight (the embedding keeps its own
        when tied; untied, the plain copy is dropped)."""
        self._packed = pack_onednn_weight(self.weight, batch_hint)
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, hidden_size] -> [N, vocab_size]
        if self._packed is not None:
            return onednn_linear(hidden_states, self._packed, None)
        return F.linear(hidden_states, self.weight)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, tied={self.tied}"
