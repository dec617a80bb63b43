"""The common decoder with mixture-of-experts MLPs: what every MoE family file shares.

A family (Mixtral, Qwen3-MoE, GraniteMoe) subclasses `MoEForCausalLM` together with
its dense counterpart (`class MixtralForCausalLM(MoEForCausalLM, LlamaForCausalLM)`)
and states its routing (`moe_options`), which layers are sparse (`sparse_layers`;
the others keep the dense `LlamaMLP`, e.g. Qwen3-MoE's `mlp_only_layers`), the size of
its shared-experts MLP if it has one (`shared_intermediate_size`, built as a
`LlamaMLP` at `mlp.shared_mlp`), and how its checkpoint names the MoE block
(`checkpoint_renames`, applied before the expert renaming of `fused_moe`).

Invariants:
- The MoE block sits where the dense MLP was (`model.layers.N.mlp`), as `FusedMoE`
  with `gate` (router) and `experts.w13` / `experts.w2` (stacked); attention and
  any dense MLP layers are the common decoder's, so LoRA and aLoRA reach them
  unchanged. Expert weights are never adaptable.
- Routing options this engine does not implement are refused at construction,
  naming the option (`check_routing_options`), never silently ignored.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Iterable

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import (
    FusedMoE,
    MoEOptions,
    check_silu,
    expert_packed_mapping,
    rename_expert_weight,
)
from vllm.model_executor.models.llama import DecoderOptions, LlamaMLP

# Config fields of routing variants that no family here implements, with the values
# that mean "not used". Any other value is refused.
_UNSUPPORTED_ROUTING = {
    "scoring_func": (None, "softmax"),  # e.g. DeepSeek-V3's "sigmoid"
    "topk_method": (None, "greedy"),  # grouped top-k ("group_limited_greedy", "noaux_tc")
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1.0),
    "n_shared_experts": (None, 0),
    "shared_expert_intermediate_size": (None, 0),
    "moe_layer_freq": (None, 1),
}


def check_routing_options(config: Any) -> None:
    name = (getattr(config, "architectures", None) or ["This model"])[0]
    for field, unused in _UNSUPPORTED_ROUTING.items():
        value = getattr(config, field, None)
        if value not in unused:
            raise ValueError(
                f"{name}: MoE config option {field}={value!r} is not supported (supported: "
                f"{field} in {[v for v in unused if v is not None] or 'unset'}; routing: softmax over "
                "experts then top-k with optional renormalisation, or top-k then softmax)."
            )
    check_silu(config)


def _build_mlp(moe: MoEOptions, sparse: frozenset, shared_size: int, config: Any, options: DecoderOptions,
               layer_index: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    if layer_index not in sparse:
        return LlamaMLP(config, options, dtype, device)
    shared = None
    if shared_size > 0:
        shared = LlamaMLP(config, replace(options, intermediate_size=shared_size), dtype, device)
    return FusedMoE(config.hidden_size, moe, dtype, device, shared_mlp=shared)


class MoEForCausalLM:
    """Mixin over a dense model class (see module docstring)."""

    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def moe_options(cls, config: Any) -> MoEOptions:
        raise NotImplementedError

    @classmethod
    def sparse_layers(cls, config: Any) -> list[int]:
        return list(range(config.num_hidden_layers))

    @classmethod
    def shared_intermediate_size(cls, config: Any) -> int:
        """Size of the shared-experts MLP next to the routed experts; 0: none."""
        return 0

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        check_routing_options(hf_config)
        super().__init__(hf_config, dtype, device)
        # Instance-level: the expert slices depend on the config's number of experts.
        self.packed_modules_mapping = {
            **type(self).packed_modules_mapping,
            **expert_packed_mapping(self.moe_options(hf_config).num_experts),
        }

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        factory = partial(_build_mlp, cls.moe_options(config), frozenset(cls.sparse_layers(config)),
                          cls.shared_intermediate_size(config))
        return replace(super().decoder_options(config), mlp_factory=factory)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((self._rename(name), tensor) for name, tensor in weights)

    def _rename(self, name: str) -> str:
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        return rename_expert_weight(name)
