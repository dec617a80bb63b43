"""Default sampling parameters: the model creator's `generation_config.json`, as vLLM applies them.

`--generation-config` (`EngineArgs.generation_config`) says where defaults come from:
- `auto` (default): the model folder's `generation_config.json`;
- `vllm`: none (vLLM's own defaults: temperature 1.0, top_p 1.0, ...);
- a folder: that folder's `generation_config.json`.
`--override-generation-config JSON` then sets or replaces individual defaults.

Only sampling fields are taken (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` as `max_tokens`), so a generation config
written for `transformers.generate` (e.g. `do_sample`, `num_beams`) changes nothing else.
The defaults fill the fields a request leaves unset, offline
(`LLM.get_default_sampling_params()`, used when `sampling_params` is omitted) and on the
server (fields absent from the request body). Invariant: the result maps SamplingParams
field names to values SamplingParams accepts (checked once at start-up).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

# generation_config.json key -> SamplingParams field
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GENERATION_CONFIG_FILE = "generation_config.json"


def parse_json_object(option: str, value: Union[None, str, dict]) -> dict[str, Any]:
    """An option given as a JSON object (a string on the command line, a dict offline)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option} must be a JSON object, got {value!r} ({e}).") from e
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {type(value).__name__}.")
    return dict(value)


def load_sampling_defaults(model_dir: str, generation_config: str = "auto",
                           overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """SamplingParams field -> default value (see module docstring)."""
    if generation_config == "vllm":
        raw: dict[str, Any] = {}
    else:
        folder = model_dir if generation_config == "auto" else generation_config
        if generation_config != "auto" and not os.path.isdir(folder):
            raise ValueError(f"--generation-config must be 'auto', 'vllm' or a folder; {folder!r} is not a folder.")
        raw = _read(os.path.join(folder, GENERATION_CONFIG_FILE))
    raw.update(overrides or {})
    unknown = sorted(k for k in (overrides or {}) if k not in _FIELDS)
    if unknown:
        raise ValueError(f"--override-generation-config: unsupported keys {unknown}; supported: {sorted(_FIELDS)}.")
    defaults = {_FIELDS[k]: v for k, v in raw.items() if k in _FIELDS and v is not None}
    _validate(defaults)
    return defaults


def _read(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read {path!r}: {e}") from e
    return data if isinstance(data, dict) else {}


def _validate(defaults: dict[str, Any]) -> None:
    from vllm.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Invalid default sampling parameters {defaults} from the generation config: {e}") from e
