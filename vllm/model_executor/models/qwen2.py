"""Qwen2: the Llama decoder with biases on q, k and v (never on o_proj or the MLP).

Sliding-window layers (`use_sliding_window`: layers from `max_window_layers` on, as
`layer_types` lists them) get their window from the common decoder.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False, mlp_bias=False)
