"""Granite (IBM Granite 3.x dense): the Llama decoder with four scalar multipliers.

- `embedding_multiplier`: token embeddings are scaled by it.
- `attention_multiplier`: the attention softmax scale (replaces head_size ** -0.5).
- `residual_multiplier`: each attention / MLP output is scaled before the residual add.
- `logits_scaling`: logits are divided by it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return replace(
            super().decoder_options(config),
            attention_scale=config.attention_multiplier,
            embedding_multiplier=config.embedding_multiplier,
            residual_multiplier=config.residual_multiplier,
            logits_scaling=config.logits_scaling,
        )
