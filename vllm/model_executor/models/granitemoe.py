"""GraniteMoe (`GraniteMoeForCausalLM`, Granite 3.x MoE) and GraniteMoeShared (the same with
shared experts, below): the Granite decoder (its four
multipliers) whose every MLP is a mixture of experts routed top-k first: the top
`num_experts_per_tok` router logits are kept and softmaxed among themselves.

Checkpoint names: `block_sparse_moe.router.layer` (router), and the experts already
stacked, `block_sparse_moe.input_linear` `[E, 2 * intermediate, hidden]` (gate rows
first, then up) and `block_sparse_moe.output_linear` `[E, hidden, intermediate]`,
which are exactly our `w13` and `w2`.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.fused_moe import MoEOptions
from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.moe import MoEForCausalLM


class GraniteMoeForCausalLM(MoEForCausalLM, GraniteForCausalLM):
    checkpoint_renames = (
        (".block_sparse_moe.router.layer.", ".mlp.gate."),
        (".block_sparse_moe.input_linear.", ".mlp.experts.w13."),
        (".block_sparse_moe.output_linear.", ".mlp.experts.w2."),
    )

    @classmethod
    def moe_options(cls, config: Any) -> MoEOptions:
        return MoEOptions(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            scoring="topk_softmax",
        )


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """GraniteMoe plus a shared-experts MLP per layer (`shared_mlp.input_linear`, gate and
    up fused with gate rows first, and `shared_mlp.output_linear`), added to the routed
    experts' output. It loads as our `mlp.shared_mlp` (a dense MLP that takes LoRA; PEFT's
    names for it are aliased)."""

    checkpoint_renames = GraniteMoeForCausalLM.checkpoint_renames + (
        (".shared_mlp.input_linear.", ".mlp.shared_mlp.gate_up_proj."),
        (".shared_mlp.output_linear.", ".mlp.shared_mlp.down_proj."),
    )
    # PEFT module suffix -> (our module suffix, slice index or None for every slice).
    peft_module_aliases = {
        "shared_mlp.input_linear": ("mlp.shared_mlp.gate_up_proj", None),
        "shared_mlp.output_linear": ("mlp.shared_mlp.down_proj", 0),
    }

    @classmethod
    def shared_intermediate_size(cls, config: Any) -> int:
        return getattr(config, "shared_intermediate_size", 0) or 0
