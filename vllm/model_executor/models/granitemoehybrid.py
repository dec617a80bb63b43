"""Granite 4 (`GraniteMoeHybridForCausalLM`) without Mamba layers or experts: the Granite
decoder whose dense MLP is the "shared MLP".

A Granite 4 checkpoint names the MLP `shared_mlp.input_linear` (gate and up fused, gate
rows first, `[2 * shared_intermediate_size, hidden]`) and `shared_mlp.output_linear`
(down). These load into the common decoder's `gate_up_proj` and `down_proj`, so every
layer, kernel and LoRA path is the one Granite 3 and Llama use. PEFT adapters trained
on these models name the same two modules: `peft_module_aliases` maps them onto our
fused modules (`input_linear` covers both slices with one A and a B split by rows).

`position_embedding_type` is "rope" (granite-4.0-micro and the dense 4.x) or absent
(no positional encoding in attention). A config with Mamba layers ("mamba", or
"linear_attention" as transformers 5 spells it) or with experts (`num_local_experts >
0`) is refused at load, naming the layer kinds this engine lacks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

import torch

from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.llama import DecoderOptions

ATTENTION_LAYER_TYPES = ("attention", "full_attention")

# Checkpoint module name -> ours, for the parts Granite 4 names differently.
_RENAMES = ((".shared_mlp.input_linear.", ".mlp.gate_up_proj."), (".shared_mlp.output_linear.", ".mlp.down_proj."))


def check_dense_attention_only(config: Any) -> None:
    """Refuse Granite 4 configs whose layers this engine cannot run, saying which."""
    name = (getattr(config, "architectures", None) or ["GraniteMoeHybridForCausalLM"])[0]
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    missing = []
    if other:
        indices = [i for i, t in enumerate(layer_types) if t not in ATTENTION_LAYER_TYPES]
        shown = ", ".join(map(str, indices[:8])) + (" ..." if len(indices) > 8 else "")
        missing.append(f"Mamba layers (layer_types {', '.join(map(repr, other))} at layers {shown})")
    experts = getattr(config, "num_local_experts", 0) or 0
    if experts > 0:
        missing.append(f"mixture-of-experts MLPs (num_local_experts={experts})")
    if missing:
        raise ValueError(
            f"{name} checkpoint uses {' and '.join(missing)}, which this engine does not support. "
            "Supported: Granite 4 models whose layers are all attention with a dense shared MLP "
            "(layer_types all 'attention', num_local_experts=0), such as granite-4.0-micro."
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

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        check_dense_attention_only(hf_config)
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
