"""Mixtral (`MixtralForCausalLM`): the Llama/Mistral decoder whose every MLP is a
mixture of experts: softmax over `num_local_experts` router scores, top
`num_experts_per_tok` kept and renormalised to sum to 1.

Checkpoint names: `block_sparse_moe.gate` (router) and `block_sparse_moe.experts.N.w1`
(gate), `w3` (up), `w2` (down); transformers 5 calls the block `mlp` and may store the
experts fused (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Both load.
A sliding window (Mixtral-8x7B-v0.1's config declares none) holds for every layer.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.fused_moe import MoEOptions
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.moe import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM, LlamaForCausalLM):
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def moe_options(cls, config: Any) -> MoEOptions:
        return MoEOptions(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            scoring="softmax_topk",
            renormalize=True,
        )
