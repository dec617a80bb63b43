"""`PEFTHelper`: reads and validates a PEFT adapter's `adapter_config.json`, once per load.

What it accepts: `peft_type` LORA with `r`, `lora_alpha`, `use_rslora`,
`target_modules` (list or regex), `rank_pattern` / `alpha_pattern`, and the aLoRA
fields. An adapter is an aLoRA when `alora_invocation_tokens` is a non-empty list
(PEFT >= 0.17). Legacy IBM configs carry `invocation_string` instead: we tokenise it
with the base model's tokenizer, `add_special_tokens=False`, and treat the ids
exactly like `alora_invocation_tokens` (what the alora package does at training).
What it refuses, with a message naming the adapter: other PEFT types, DoRA,
`modules_to_save`, trained biases, `layers_to_transform`, `target_parameters`,
trainable token indices, and malformed fields (`r`, `lora_alpha`, `use_rslora`,
`target_modules`, `rank_pattern`/`alpha_pattern` values and regex keys): a ValueError naming
the adapter and the field, never another exception.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Union


@dataclass(frozen=True)
class PEFTHelper:
    name: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: Union[list[str], str]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    invocation_tokens: Optional[tuple[int, ...]] = None

    @property
    def is_alora(self) -> bool:
        return bool(self.invocation_tokens)

    def scaling(self, module_name: str, rank: int) -> float:
        """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        alpha = _match_pattern(self.alpha_pattern, module_name, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @classmethod
    def from_dir(
        cls,
        name: str,
        path: str,
        tokenize: Optional[Callable[[str], list[int]]] = None,
    ) -> "PEFTHelper":
        config_path = os.path.join(path, "adapter_config.json")
        if not os.path.isdir(path):
            raise ValueError(f"LoRA adapter {name!r}: path {path!r} does not exist or is not a folder.")
        if not os.path.isfile(config_path):
            raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}.")
        try:
            with open(config_path) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"LoRA adapter {name!r}: cannot read adapter_config.json: {e}") from e
        return cls.from_config(name, config, tokenize)

    @classmethod
    def from_config(cls, name: str, config: dict, tokenize: Optional[Callable[[str], list[int]]] = None) -> "PEFTHelper":
        def refuse(reason: str) -> None:
            raise ValueError(f"LoRA adapter {name!r} is not supported: {reason}.")

        peft_type = str(config.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            refuse(f"peft_type {peft_type!r} (only LORA adapters, including aLoRA, are served)")
        if config.get("use_dora"):
            refuse("DoRA (use_dora=true)")
        if config.get("modules_to_save"):
            refuse(f"modules_to_save {config['modules_to_save']} (fully trained modules)")
        if config.get("bias", "none") != "none" or config.get("lora_bias"):
            refuse("trained biases (bias / lora_bias)")
        if config.get("layers_to_transform") is not None:
            refuse("layers_to_transform")
        if config.get("target_parameters"):
            refuse("target_parameters")
        if config.get("trainable_token_indices"):
            refuse("trainable_token_indices")
        r = config.get("r")
        if not isinstance(r, int) or r < 1:
            refuse(f"r must be a positive integer, got {r!r}")
        target_modules = config.get("target_modules")
        if not target_modules:
            refuse("target_modules is empty")
        if not isinstance(target_modules, str) and not (
                isinstance(target_modules, list) and all(isinstance(m, str) for m in target_modules)):
            refuse(f"target_modules must be a list of module names or a regex string, got {target_modules!r}")
        lora_alpha = config.get("lora_alpha", r)
        if not _is_number(lora_alpha):
            refuse(f"lora_alpha must be a finite number, got {lora_alpha!r}")
        use_rslora = config.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            refuse(f"use_rslora must be true or false, got {use_rslora!r}")
        return cls(
            name=name,
            r=r,
            lora_alpha=float(lora_alpha),
            use_rslora=use_rslora,
            target_modules=target_modules,
            rank_pattern=_pattern(refuse, "rank_pattern", config.get("rank_pattern"), positive_int=True),
            alpha_pattern=_pattern(refuse, "alpha_pattern", config.get("alpha_pattern"), positive_int=False),
            invocation_tokens=_invocation_tokens(name, config, tokenize),
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pattern(refuse, field_name: str, value, positive_int: bool) -> dict:
    """`rank_pattern` (module pattern -> rank >= 1) or `alpha_pattern` (-> finite number);
    each key must compile, since it is matched as a regex."""
    if not value:
        return {}
    if not isinstance(value, dict):
        refuse(f"{field_name} must be an object mapping module patterns to values, got {value!r}")
    for key, item in value.items():
        ok = isinstance(item, int) and not isinstance(item, bool) and item >= 1 if positive_int else _is_number(item)
        if not ok:
            refuse(f"{field_name}[{key!r}] must be {'a positive integer' if positive_int else 'a finite number'}, "
                   f"got {item!r}")
        try:
            re.compile(key)
        except re.error as e:
            refuse(f"{field_name} key {key!r} is not a valid regex ({e})")
    return dict(value)


def _invocation_tokens(name: str, config: dict, tokenize) -> Optional[tuple[int, ...]]:
    tokens = config.get("alora_invocation_tokens")
    if tokens is not None:
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise ValueError(f"LoRA adapter {name!r}: alora_invocation_tokens must be a list of token ids.")
        return tuple(tokens) or None
    text = config.get("invocation_string")
    if text:
        if tokenize is None:
            raise ValueError(f"LoRA adapter {name!r}: its invocation_string needs the base tokenizer.")
        return tuple(tokenize(text)) or None
    return None


def _match_pattern(patterns: dict, module_name: str, default):
    """PEFT's rule: a pattern key matches a module when the name ends with it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default
