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

Quantized (`LMHead.quantize`, `--quantization int8|int4`; or a GGUF file storing the head
quantized): the head keeps only a `QuantizedWeight` (layers/quantization.py) of this rank's rows,
int8 per output channel whatever the method (llama.cpp keeps its output matrix at 6-8 bits too:
the head is small next to the linears in FLOPs but not in bytes, and int4 there costs accuracy).
Tied, the embedding keeps its table in the model dtype for lookups and the head its own packed
copy; untied, the dense head weight is dropped. The packed head is held in the kernel's row tiles
where it has them (`quantization.tile`), as the linears are: SmolLM2's int4 decode step the same at
batch 1, 0.81-0.93x at 16 (one and two Zen 4 threads). A quantized checkpoint tensor loaded into the
embedding is dequantized into its table.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import all_gather, all_reduce, get_tp
from vllm.model_executor.layers.dense_gemv import dense_linear
from vllm.model_executor.layers.linear import default_weight_loader, onednn_linear, pack_onednn_weight
from vllm.model_executor.layers.quantization import METHODS, QuantizedWeight, quantize, quantized_linear, tile
from vllm.model_executor.layers.tensor_parallel import vocab_range

# What the head is quantized to under every `--quantization` method: per output channel int8.
HEAD_METHOD = "int8"


def _vocab_weight(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """This rank's rows of a [vocab_size, hidden_size] table, loaded from the full checkpoint tensor."""
    first, rows = vocab_range(vocab_size)
    weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)
    if rows == vocab_size:
        weight.weight_loader = load_full
        return weight

    def load_block(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if isinstance(loaded, QuantizedWeight):
            loaded = loaded.dequantize()  # [vocab_size, hidden_size] fp32
        if loaded.shape != (vocab_size, hidden_size):
            raise ValueError(f"shape mismatch: the model expects {(vocab_size, hidden_size)}, the checkpoint "
                             f"has {tuple(loaded.shape)}")
        real = max(0, min(rows, vocab_size - first))
        param.data[real:].zero_()
        default_weight_loader(param.data[:real], loaded.narrow(0, first, real), shard_id)

    weight.weight_loader = load_block
    return weight


def load_full(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
    """An unsharded table's loader: a quantized checkpoint tensor is dequantized into it."""
    if isinstance(loaded, QuantizedWeight):
        loaded = loaded.dequantize()
    default_weight_loader(param, loaded, shard_id)


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
        self._quantized: Optional[QuantizedWeight] = None  # this rank's rows, once quantized
        if self.tied:
            # The same Parameter object: named_parameters() lists it once, under the
            # embedding's name, so the loader fills it once.
            self.weight = tied_embedding.weight
        else:
            self.weight = _vocab_weight(vocab_size, hidden_size, dtype, device)
        dense_loader = self.weight.weight_loader

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
            if isinstance(loaded, QuantizedWeight):
                self._load_quantized(loaded)
                if not self.tied:  # an untied head keeps no dense copy; a tied table is dequantized below
                    return
            dense_loader(param, loaded, shard_id)

        self.weight.weight_loader = load

    def _load_quantized(self, weight: QuantizedWeight) -> None:
        """Keep a head stored quantized (GGUF) as it is."""
        if self.sharded:
            raise ValueError("a quantized LM head loads only unsharded (tensor_parallel_size 1)")
        if (weight.out_features, weight.in_features) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"shape mismatch: the LM head expects {(self.vocab_size, self.hidden_size)}, the "
                             f"checkpoint has {(weight.out_features, weight.in_features)}")
        self._quantized = tile(weight)
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def quantize(self, method: str) -> None:
        """`--quantization method`: keep this rank's rows as per-channel int8 (`HEAD_METHOD`) for
        every method; a head the checkpoint stored quantized stays as it is."""
        if method not in METHODS:
            raise ValueError(f"Unknown quantization {method!r}; supported: {', '.join(METHODS)}.")
        if self._quantized is not None:
            return
        self._quantized = tile(quantize(self.weight, HEAD_METHOD))
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def quantized_weights(self) -> list[QuantizedWeight]:
        """The head's quantized form, if it has one."""
        return [] if self._quantized is None else [self._quantized]

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the head's own weight however it is stored (a tied dense head shares the embedding's)."""
        if self._quantized is not None:
            return self._quantized.nbytes
        return vocab_range(self.vocab_size)[1] * self.hidden_size * self.weight.element_size()

    def pack_for_onednn(self, batch_hint: int) -> None:
        """CPU fast path: a pre-packed copy of the weight (the embedding keeps its own
        when tied; untied, the plain copy is dropped). A quantized head stays quantized."""
        if self._quantized is not None:
            return
        self._packed = pack_onednn_weight(self.weight, batch_hint)
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, hidden_size] -> [N, vocab_size]
        if self._quantized is not None:
            logits = quantized_linear(hidden_states, self._quantized, None)
        elif self._packed is not None:
            logits = onednn_linear(hidden_states, self._packed, None)
        else:
            logits = dense_linear(hidden_states, self.weight)  # few rows on the CPU: the native kernels
        if not self.sharded:
            return logits
        return all_gather(logits, dim=-1)[:, : self.vocab_size]  # [N, vocab_size]

    def extra_repr(self) -> str:
        quantized = "" if self._quantized is None else f", quantized={self._quantized.method}"
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, tied={self.tied}{quantized}"
