"""Granite 4 (`GraniteMoeHybridForCausalLM`) whose layers are all attention: the Granite
decoder whose dense MLP is the "shared MLP", with or without mixture-of-experts MLPs.

A Granite 4 checkpoint names the MLP `shared_mlp.input_linear` (gate and up fused, gate
rows first, `[2 * shared_intermediate_size, hidden]`) and `shared_mlp.output_linear`
(down). Without experts (granite-4.0-micro, the dense 4.x) these load into the common
decoder's `gate_up_proj` and `down_proj`, so every layer, kernel and LoRA path is the
one Granite 3 and Llama use. PEFT adapters trained on these models name the same two
modules: `peft_module_aliases` maps them onto our fused modules (`input_linear` covers
both slices with one A and a B split by rows).

With experts (`num_local_experts > 0`) each layer adds the routed experts
(`block_sparse_moe.router.layer`, `block_sparse_moe.input_linear` / `output_linear`,
routed top-k then softmax like GraniteMoe) to the shared MLP: exactly GraniteMoeShared
on the Granite 4 decoder, served by `GraniteMoeHybridMoeForCausalLM` through the MoE
mixin (models/moe.py). The registry has one class per architecture name, so
`GraniteMoeHybridForCausalLM(config, ...)` builds that variant itself when the config
has experts (`__new__`); a dense config builds the dense model exactly as before.

`position_embedding_type` is "rope" (granite-4.0-micro and the dense 4.x) or absent
(no positional encoding in attention). A config with Mamba layers ("mamba", or
"linear_attention" as transformers 5 spells it) is refused at load, naming the layers.
Subclasses that reuse the dense model (Granite Switch) refuse experts as well.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

import torch

from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.granitemoe import GraniteMoeSharedForCausalLM
from vllm.model_executor.models.llama import DecoderOptions
from vllm.model_executor.models.moe import MoEForCausalLM

ATTENTION_LAYER_TYPES = ("attention", "full_attention")

# Checkpoint module name -> ours, for the parts Granite 4 names differently.
_RENAMES = ((".shared_mlp.input_linear.", ".mlp.gate_up_proj."), (".shared_mlp.output_linear.", ".mlp.down_proj."))


def num_experts_of(config: Any) -> int:
    return getattr(config, "num_local_experts", 0) or 0


def check_attention_only(config: Any, allow_experts: bool = False) -> None:
    """Refuse Granite 4 configs whose layers this engine cannot run, saying which."""
    name = (getattr(config, "architectures", None) or ["GraniteMoeHybridForCausalLM"])[0]
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    missing = []
    if other:
        indices = [i for i, t in enumerate(layer_types) if t not in ATTENTION_LAYER_TYPES]
        shown = ", ".join(map(str, indices[:8])) + (" ..." if len(indices) > 8 else "")
        missing.append(f"Mamba layers (layer_types {', '.join(map(repr, other))} at layers {shown})")
    experts = num_experts_of(config)
    if experts > 0 and not allow_experts:
        missing.append(f"mixture-of-experts MLPs (num_local_experts={experts})")
    if missing:
        mlp = "with a dense shared MLP or with experts next to it" if allow_experts else \
            "with a dense shared MLP (num_local_experts=0)"
        raise ValueError(
            f"{name} checkpoint uses {' and '.join(missing)}, which this engine does not support. "
            f"Supported: Granite 4 models whose layers are all attention (layer_types all 'attention') {mlp}, "
            "such as granite-4.0-micro."
        )
    embedding = getattr(config, "position_embedding_type", None)
    if embedding not in (None, "rope", "nope"):
        raise ValueError(f"{name}: position_embedding_type {embedding!r} is not supported; use 'rope' or none.")


def rename_checkpoint_weight(name: str) -> str:
    for theirs, ours in _RENAMES:
        if theirs in name:
            return name.replace(theirs, ours)
    return name


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    # PEFT module suffix -> (our module suffix, slice index or None for every slice).
    peft_module_aliases = {
        "shared_mlp.input_linear": ("mlp.gate_up_proj", None),
        "shared_mlp.output_linear": ("mlp.down_proj", 0),
    }

    def __new__(cls, *args: Any, **kwargs: Any):
        # Granite 4 with experts is another network under the same architecture name.
        # Only the registry's class dispatches (subclasses keep their own), and only when
        # given a config (copy/pickle call __new__ with no arguments).
        config = args[0] if args else kwargs.get("hf_config")
        target = cls
        if cls is GraniteMoeHybridForCausalLM and config is not None and num_experts_of(config) > 0:
            target = GraniteMoeHybridMoeForCausalLM
        return super().__new__(target)

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        # This architecture serves experts (through the MoE variant, see __new__), so for it the
        # flag only words the Mamba refusal; subclasses reusing the dense model (Granite
        # Switch) refuse experts.
        serves_experts = type(self) is GraniteMoeHybridForCausalLM or isinstance(self, MoEForCausalLM)
        check_attention_only(hf_config, allow_experts=serves_experts)
        super().__init__(hf_config, dtype, device)

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return replace(
            super().decoder_options(config),
            mlp_bias=False,
            rope=getattr(config, "position_embedding_type", None) == "rope",
            intermediate_size=config.shared_intermediate_size,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((rename_checkpoint_weight(name), tensor) for name, tensor in weights)


class GraniteMoeHybridMoeForCausalLM(GraniteMoeSharedForCausalLM, GraniteMoeHybridForCausalLM):
    """Granite 4 with experts (the MLP of granite-4.0-h-tiny/small, in a checkpoint whose
    layers are all attention): GraniteMoeShared's routing, checkpoint names and PEFT
    aliases (the shared MLP is `mlp.shared_mlp`, a dense MLP that takes LoRA) on the
    Granite 4 decoder options (RoPE or none). MRO: the MoE mixin wraps the Granite 4 model, so its renames run
    first and leave no `shared_mlp.input_linear` for the dense renames to touch."""
