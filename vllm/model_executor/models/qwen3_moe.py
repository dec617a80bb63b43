"""Qwen3-MoE (`Qwen3MoeForCausalLM`): the Qwen3 decoder (per-head q/k RMSNorm) whose
MLPs are mixtures of `num_experts` experts of size `moe_intermediate_size`: softmax
over the router scores, top `num_experts_per_tok` kept, renormalised when
`norm_topk_prob`.

Layer `i` is sparse when it is not in `mlp_only_layers` and `(i + 1) %
decoder_sparse_step == 0`; the others keep a dense MLP of `intermediate_size`
(adaptable by LoRA like any dense MLP). Checkpoint names: `mlp.gate` (router),
`mlp.experts.N.gate_proj/up_proj/down_proj`, or transformers 5's fused
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.fused_moe import MoEOptions
from vllm.model_executor.models.moe import MoEForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM, Qwen3ForCausalLM):
    @classmethod
    def moe_options(cls, config: Any) -> MoEOptions:
        return MoEOptions(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            scoring="softmax_topk",
            renormalize=bool(config.norm_topk_prob),
        )

    @classmethod
    def sparse_layers(cls, config: Any) -> list[int]:
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        if config.num_experts <= 0:
            return []
        return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]
