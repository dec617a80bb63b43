"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k
(`q_norm`, `k_norm`, weight `[head_dim]`) applied before rotary, and an explicit
`head_dim` that need not equal hidden_size / num_heads.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
