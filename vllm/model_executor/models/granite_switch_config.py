"""Reading a Granite Switch checkpoint's configuration (granite-switch 0.1.1 format).

A Switch checkpoint is a Granite 4 base with LoRA/aLoRA adapters embedded in its
weights, each switched on by its own control token. transformers does not know its
`model_type` ("granite_switch"), so the engine reads `config.json` itself into a
`GraniteMoeHybridConfig` (the class the format derives from) carrying a frozen
`SwitchSpec` as `config.switch`.

Invariants of the config this returns:
- `num_hidden_layers` counts decoder layers only: the format adds 2 for the package's
  attention-based switch slots, which this engine replaces by an integer scan.
- `head_dim` is the format's `projection_head_dim`.
- `SwitchSpec.control_token_ids[a - 1]` is the control token of adapter index `a`
  (1-based, 0 = base); `reset_token_id` is `<|base_reset|>` when the checkpoint has one.
- Legacy single-switch, Shadow-Residual (`dual_stream`) and `unfused_qkv` checkpoints,
  and control ids that disagree with the vocabulary or `adapter_index.json`, are refused
  with a ValueError naming the problem.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

SWITCH_ARCHITECTURES = ("GraniteSwitchForCausalLM", "SRSwitchForCausalLM", "ShadowResidualForCausalLM")
MODEL_TYPE = "granite_switch"
ADAPTER_INDEX_FILE = "adapter_index.json"
# Decoder-layer slots the format adds for its attention-based switch.
SWITCH_LAYER_SLOTS = 2


@dataclass(frozen=True)
class SwitchSpec:
    """The embedded adapters of a Switch checkpoint, in adapter-index order (1-based)."""

    adapter_names: tuple[str, ...]
    control_token_ids: tuple[int, ...]
    substitute_token_ids: tuple[int, ...]  # per control token: the id the decoder embeds instead
    technologies: tuple[str, ...]  # "alora" / "lora" per adapter ("unknown" without adapter_index.json)
    ranks: tuple[int, ...]
    reset_token_id: Optional[int] = None
    reset_substitute_id: Optional[int] = None

    @property
    def num_adapters(self) -> int:
        return len(self.adapter_names)

    def adapter_index(self, name: str) -> int:
        """1-based index of the adapter called `name` (ValueError listing the names if unknown)."""
        if name not in self.adapter_names:
            raise ValueError(
                f"Unknown adapter {name!r}: this Granite Switch checkpoint embeds "
                f"{', '.join(map(repr, self.adapter_names))}."
            )
        return self.adapter_names.index(name) + 1

    def control_to_adapter(self) -> dict[int, int]:
        """Control token id -> adapter index (0 for `<|base_reset|>`)."""
        table = {token: i + 1 for i, token in enumerate(self.control_token_ids)}
        if self.reset_token_id is not None:
            table[self.reset_token_id] = 0
        return table


def is_granite_switch(config_dict: dict) -> bool:
    architectures = config_dict.get("architectures") or []
    return config_dict.get("model_type") == MODEL_TYPE or any(a in SWITCH_ARCHITECTURES for a in architectures)


def load_granite_switch_config(model_dir: str, config_dict: dict):
    """The checkpoint's config as a `GraniteMoeHybridConfig` with `.switch` (see module docstring)."""
    from transformers import GraniteMoeHybridConfig

    _refuse_unsupported(config_dict)
    # The inherited Mamba and audio settings describe nothing this format uses.
    fields = {k: v for k, v in config_dict.items()
              if k not in ("model_type", "transformers_version", "time_step_limit")
              and not k.startswith(("mamba_", "asr_"))}
    num_adapters = int(fields.get("num_adapters") or 0)
    if num_adapters > 0:
        fields["num_hidden_layers"] = int(fields["num_hidden_layers"]) - SWITCH_LAYER_SLOTS
    layers = fields["num_hidden_layers"]
    if fields.get("layer_types"):
        fields["layer_types"] = list(fields["layer_types"])[:layers]
    if fields.get("projection_head_dim"):
        fields["head_dim"] = fields["projection_head_dim"]
    fields.setdefault("num_local_experts", 0)
    fields.setdefault("shared_intermediate_size", fields.get("intermediate_size"))
    fields.setdefault("position_embedding_type", "rope")
    fields["architectures"] = ["GraniteSwitchForCausalLM"]
    config = GraniteMoeHybridConfig(**fields)
    config.switch = _switch_spec(model_dir, config_dict, num_adapters)
    return config


def _refuse_unsupported(config: dict) -> None:
    has_adapters = int(config.get("num_adapters") or 0) > 0
    switch_type = config.get("switch_type")
    if has_adapters and ((config.get("ms_code_m") is None and switch_type is None)
                         or (switch_type is not None and switch_type != "multi")):
        raise ValueError(
            "This is a legacy single-switch Granite Switch checkpoint (no multi-switch settings: "
            f"ms_code_m={config.get('ms_code_m')!r}, switch_type={switch_type!r}), which is not supported. "
            "Re-compose it with granite-switch >= 0.1.1 (compose_granite_switch)."
        )
    if config.get("dual_stream") or config.get("cross_stream_rank"):
        raise ValueError(
            "This Granite Switch checkpoint uses Shadow-Residual adapters (dual_stream / cross_stream_rank), "
            "which are not supported. Supported: single-stream LoRA and aLoRA Switch checkpoints."
        )
    if config.get("asr_enabled"):
        raise ValueError("This Granite Switch checkpoint enables the audio front-end (asr_enabled), which is not "
                         "supported; text-only checkpoints are.")
    if config.get("unfused_qkv"):
        raise ValueError("Granite Switch checkpoints with unfused_qkv=True are not supported (as in granite-switch).")


def _switch_spec(model_dir: str, config: dict, num_adapters: int) -> SwitchSpec:
    names = tuple(config.get("adapter_names") or ())
    tokens = [int(t) for t in config.get("adapter_token_ids") or ()]
    substitutes = [int(t) for t in config.get("adapter_substitute_token_ids") or ()]
    vocab = int(config["vocab_size"])
    if len(names) != num_adapters:
        raise ValueError(f"Granite Switch config lists {len(names)} adapter_names for num_adapters={num_adapters}.")
    if len(tokens) not in (num_adapters, num_adapters + 1) or len(substitutes) != len(tokens):
        raise ValueError(
            f"Granite Switch config has {len(tokens)} adapter_token_ids and {len(substitutes)} substitutes for "
            f"{num_adapters} adapters; expected {num_adapters} (or {num_adapters + 1} with <|base_reset|>) of each."
        )
    bad = [t for t in tokens + substitutes if not 0 <= t < vocab]
    if bad or len(set(tokens)) != len(tokens):
        raise ValueError(
            f"Granite Switch control table is invalid: ids must be unique control tokens in [0, {vocab}); "
            f"got adapter_token_ids={tokens}, adapter_substitute_token_ids={substitutes}."
        )
    reset = len(tokens) == num_adapters + 1
    ranks = tuple(int(r) for r in config.get("adapter_ranks") or [config.get("max_lora_rank", 0)] * num_adapters)
    spec = SwitchSpec(
        adapter_names=names,
        control_token_ids=tuple(tokens[1:] if reset else tokens),
        substitute_token_ids=tuple(substitutes[1:] if reset else substitutes),
        technologies=_technologies(model_dir, names, tokens[1:] if reset else tokens),
        ranks=ranks,
        reset_token_id=tokens[0] if reset else None,
        reset_substitute_id=substitutes[0] if reset else None,
    )
    return spec


def _technologies(model_dir: str, names: tuple[str, ...], control_ids: list[int]) -> tuple[str, ...]:
    """Per adapter "lora"/"alora" from adapter_index.json, checked against the config's table."""
    path = os.path.join(model_dir, ADAPTER_INDEX_FILE)
    if not os.path.isfile(path):
        return ("unknown",) * len(names)
    with open(path) as f:
        index = json.load(f)
    entries = index.get("adapters", index) if isinstance(index, dict) else index
    technologies = ["unknown"] * len(names)
    for entry in entries:
        i = int(entry["adapter_index"]) - 1
        control = int(entry["control_token"]["id"])
        if not 0 <= i < len(names) or entry["adapter_name"] != names[i] or control != control_ids[i]:
            raise ValueError(
                f"{ADAPTER_INDEX_FILE} names adapter {entry.get('adapter_name')!r} (index {i + 1}) with control id "
                f"{control}, which is not in the config's adapter table (names {list(names)}, control ids "
                f"{control_ids})."
            )
        technologies[i] = entry.get("technology", "unknown")
    return tuple(technologies)
