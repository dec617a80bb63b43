"""Token embedding and LM head.

`VocabEmbedding` maps token ids to rows of a `[vocab_size, hidden_size]` table.
`LMHead` projects final hidden states onto the vocabulary. With tied embeddings the
head shares the embedding's Parameter (one tensor in memory, loaded once from
`model.embed_tokens.weight`; a checkpoint's `lm_head.weight` is then ignored).

The head returns logits in the model dtype; models' `compute_logits` turns them into
float32 so sampling and logprobs do not depend on the model dtype's rounding.

Under tensor parallelism both hold one block of `ceil(vocab_size / W)` rows
(layers/tensor_parallel.py `vocab_range`; the last block's padding rows are zeros): the
embedding looks up the ids in its block, zeroes the others and all-reduces; the head
all-gathers its logits and drops the padding columns, so both return full-vocabulary results.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import all_gather, all_reduce, get_tp
from vllm.model_executor.layers.linear import default_weight_loader, onednn_linear, pack_onednn_weight
from vllm.model_executor.layers.tensor_parallel import vocab_range


def _vocab_weight(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """This rank's rows of a [vocab_size, hidden_size] table, loaded from the full checkpoint tensor."""
    first, rows = vocab_range(vocab_size)
    weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)
    if rows == vocab_size:
        weight.weight_loader = default_weight_loader
        return weight

    def load_block(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if loaded.shape != (vocab_size, hidden_size):
            raise ValueError(f"shape mismatch: the model expects {(vocab_size, hidden_size)}, the checkpoint "
                             f"has {tuple(loaded.shape)}")
        real = max(0, min(rows, vocab_size - first))
        param.data[real:].zero_()
        default_weight_loader(param.data[:real], loaded.narrow(0, first, real), shard_id)

    weight.weight_loader = load_block
    return weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = _vocab_weight(vocab_size, hidden_size, dtype, device)
        self.sharded = get_tp().world_size > 1  # fixed at build time, as the weight's rows are
        self.first_token = vocab_range(vocab_size)[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden_size]
        if not self.sharded:
            return F.embedding(input_ids, self.weight)
        first, rows = self.first_token, self.weight.shape[0]
        outside = (input_ids < first) | (input_ids >= first + rows)
        embedded = F.embedding((input_ids - first).masked_fill_(outside, 0), self.weight)
        return all_reduce(embedded.masked_fill_(outside[:, None], 0))

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
        self.sharded = get_tp().world_size > 1
        self._packed: Optional[torch.Tensor] = None
        if self.tied:
            # The same Parameter object: named_parameters() lists it once, under the
            # embedding's name, so the loader fills it once.
            self.weight = tied_embedding.weight
            return
        self.weight = _vocab_weight(vocab_size, hidden_size, dtype, device)

    def pack_for_onednn(self, batch_hint: int) -> None:
        """CPU fast path: a pre-packed copy of the weight (the embedding keeps its own
        when tied; untied, the plain copy is dropped)."""
        self._packed = pack_onednn_weight(self.weight, batch_hint)
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, hidden_size] -> [N, vocab_size]
        if self._packed is not None:
            logits = onednn_linear(hidden_states, self._packed, None)
        else:
            logits = F.linear(hidden_states, self.weight)
        if not self.sharded:
            return logits
        return all_gather(logits, dim=-1)[:, : self.vocab_size]  # [N, vocab_size]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, tied={self.tied}"
