"""System-python side of the granite-switch oracle (tests.granite_switch.oracle_env).

granite-switch 0.1.1 pins transformers 5.16-5.17, so its composer and HF model run
in their own venv (`bash tests/granite_switch/oracle/install.sh`). This module owns
the bridge: it finds that venv's python, runs the scripts in
`tests/granite_switch/oracle/` as subprocesses (JSON files in, JSON files out),
checks their exit codes and surfaces their stderr on failure.

* `build_assets(out_dir) -> Assets`: tiny base, PEFT adapters, composed switch and
  `manifest.json` (see oracle/build_assets.py), read back as a dataclass.
* `reference(switch_dir, requests) -> list[dict]`: greedy runs of the package's HF
  model, one request at a time (see oracle/reference.py for the fields).
* `render(...)` / `render_batch(...)`: chat template rendering in transformers 5.17.

Every subprocess pays ~10 s of imports and model load, so batch requests; identical
`reference`/`render_batch` calls are memoised for the session.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle")
INSTALL_CMD = "bash tests/granite_switch/oracle/install.sh"
DEFAULT_TIMEOUT_S = 600


class OracleEnvError(RuntimeError):
    """The oracle venv is missing or one of its scripts failed."""


def venv_dir() -> str:
    return os.environ.get("GRANITE_SWITCH_VENV", os.path.join(REPO_ROOT, ".venv-granite-switch"))


def venv_python() -> str:
    """Path to the oracle venv's python; raises with the install command if absent."""
    python = os.path.join(venv_dir(), "bin", "python")
    if not os.access(python, os.X_OK):
        raise OracleEnvError(
            f"granite-switch oracle venv not found at {venv_dir()}. "
            f"Create it with: {INSTALL_CMD}  (from the repository root)"
        )
    return python


def is_available() -> bool:
    try:
        venv_python()
    except OracleEnvError:
        return False
    return True


def _run(script: str, args: list[str], timeout: float = DEFAULT_TIMEOUT_S) -> None:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # keep the repo's (newer-transformers) test helpers out
    cmd = [venv_python(), os.path.join(ORACLE_DIR, script), *args]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ORACLE_DIR, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise OracleEnvError(f"oracle script timed out after {timeout}s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        raise OracleEnvError(
            f"oracle script failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"--- stderr (tail) ---\n{proc.stderr[-6000:]}\n"
            f"--- stdout (tail) ---\n{proc.stdout[-2000:]}"
        )


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    index: int  # runtime adapter index (0 = base)
    technology: str  # "lora" | "alora"
    rank: int
    alpha: int
    target_modules: list[str]
    path: str  # the PEFT adapter folder
    control_token: str
    control_token_id: int
    substitute_token_id: int
    alora_invocation_tokens: Optional[list[int]]
    sample: dict[str, Any] = field(default_factory=dict)  # messages, prompt_token_ids, text


@dataclass(frozen=True)
class Assets:
    root: str
    base_dir: str
    switch_dir: str
    base_num_hidden_layers: int
    base_vocab_size: int
    switch_vocab_size: int
    adapters: list[AdapterInfo]
    runtime_adapters: list[dict[str, Any]]  # PEFT LoRAs not composed into the switch
    adapter_token_ids: list[int]  # as in config.json: reset slot first
    adapter_substitute_token_ids: list[int]
    reset_token_id: Optional[int]
    reset_substitute_token_id: Optional[int]
    eos_token_id: int
    base_sample: dict[str, Any]
    manifest: dict[str, Any]

    def adapter(self, name: str) -> AdapterInfo:
        for info in self.adapters:
            if info.name == name:
                return info
        raise KeyError(name)

    @property
    def control_to_index(self) -> dict[int, int]:
        """Control token id -> adapter index, the reset token mapping to 0."""
        mapping = {a.control_token_id: a.index for a in self.adapters}
        if self.reset_token_id is not None:
            mapping[self.reset_token_id] = 0
        return mapping

    @property
    def runtime_adapter_dir(self) -> str:
        return self.runtime_adapters[0]["path"]


def load_assets(root: str) -> Assets:
    with open(os.path.join(root, "manifest.json")) as f:
        m = json.load(f)
    known = AdapterInfo.__dataclass_fields__
    adapters = [AdapterInfo(**{k: v for k, v in a.items() if k in known}) for a in m["adapters"]]
    return Assets(
        root=m["root"], base_dir=m["base_dir"], switch_dir=m["switch_dir"],
        base_num_hidden_layers=m["base_num_hidden_layers"], base_vocab_size=m["base_vocab_size"],
        switch_vocab_size=m["switch_vocab_size"], adapters=adapters,
        runtime_adapters=m["runtime_adapters"], adapter_token_ids=m["adapter_token_ids"],
        adapter_substitute_token_ids=m["adapter_substitute_token_ids"],
        reset_token_id=m["reset_token_id"], reset_substitute_token_id=m["reset_substitute_token_id"],
        eos_token_id=m["eos_token_id"], base_sample=m["base_sample"], manifest=m,
    )


def build_assets(out_dir: str, timeout: float = DEFAULT_TIMEOUT_S) -> Assets:
    """Build base, adapters, switch and manifest.json into `out_dir` (offline, deterministic)."""
    os.makedirs(out_dir, exist_ok=True)
    _run("build_assets.py", [os.path.abspath(out_dir)], timeout=timeout)
    return load_assets(out_dir)


_CACHE: dict[str, Any] = {}


def _call_json(mode: str, switch_dir: str, payload: Any, timeout: float) -> Any:
    key = json.dumps([mode, os.path.abspath(switch_dir), payload], sort_keys=True)
    if key in _CACHE:
        return json.loads(_CACHE[key])
    with tempfile.TemporaryDirectory(prefix="gs-oracle-") as tmp:
        in_path, out_path = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(in_path, "w") as f:
            json.dump(payload, f)
        _run("reference.py", [mode, os.path.abspath(switch_dir), in_path, out_path], timeout)
        with open(out_path) as f:
            text = f.read()
    _CACHE[key] = text
    return json.loads(text)


def reference(switch_dir: str, requests: list[dict], timeout: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Greedy reference outputs of granite-switch's HF model.

    Each request: `{"prompt_token_ids": [...], "max_tokens": N}` and optionally
    `"stop_token_ids"`. Each result: `prompt_token_ids`, `token_ids`, `logprobs`,
    `margins` (top-1 minus top-2 logit per step), `adapter_indices` (routing of
    prompt + generated tokens) and `prompt_logprobs` (`None` at position 0).
    """
    payload = [
        {"prompt_token_ids": [int(t) for t in r["prompt_token_ids"]], "max_tokens": int(r["max_tokens"]),
         **({"stop_token_ids": [int(t) for t in r["stop_token_ids"]]} if r.get("stop_token_ids") else {})}
        for r in requests
    ]
    return _call_json("generate", switch_dir, payload, timeout)


def render_batch(switch_dir: str, items: list[dict], timeout: float = DEFAULT_TIMEOUT_S) -> list[list[int]]:
    """Render many `{"messages", "adapter_name", "add_generation_prompt"}` items at once."""
    payload = [
        {"messages": it["messages"], "adapter_name": it.get("adapter_name"),
         "add_generation_prompt": bool(it.get("add_generation_prompt", True))}
        for it in items
    ]
    return _call_json("render", switch_dir, payload, timeout)


def render(switch_dir: str, messages: list[dict], adapter_name: Optional[str] = None,
           add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the switch tokenizer's chat template (transformers 5.17)."""
    item = {"messages": messages, "adapter_name": adapter_name,
            "add_generation_prompt": add_generation_prompt}
    return render_batch(switch_dir, [item])[0]
