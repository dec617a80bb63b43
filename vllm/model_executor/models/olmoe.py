"""OLMoE (`OlmoeForCausalLM`, e.g. allenai/OLMoE-1B-7B-0924): the Llama decoder with an
RMSNorm over the whole width of q and of k (not per head), optional clamping of q, k
and v to `[-clip_qkv, clip_qkv]` after that norm, and a mixture of `num_experts`
experts in every layer: softmax over the router scores, top `num_experts_per_tok`
kept, renormalised only when `norm_topk_prob` (false in the released models).

Checkpoint names: `self_attn.q_norm` / `self_attn.k_norm` (widths `num_heads *
head_size` and `num_kv_heads * head_size`), `mlp.gate` (router), and the experts
either per expert (`mlp.experts.N.gate_proj/up_proj/down_proj`, what the released
checkpoints and transformers' `save_pretrained` write) or fused
(`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, transformers 5's in-memory
layout). All load without renaming; attention takes LoRA as in any common-decoder model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm.model_executor.layers.fused_moe import MoEOptions
from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM
from vllm.model_executor.models.moe import MoEForCausalLM


class OlmoeForCausalLM(MoEForCausalLM, LlamaForCausalLM):
    @classmethod
    def moe_options(cls, config: Any) -> MoEOptions:
        return MoEOptions(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            scoring="softmax_topk",
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        clip = getattr(config, "clip_qkv", None)
        if clip is not None and not clip > 0:
            raise ValueError(f"OlmoeForCausalLM: clip_qkv must be a positive number or null, got {clip!r}.")
        return replace(super().decoder_options(config), qk_norm_full_width=True,
                       clip_qkv=None if clip is None else float(clip))
