"""Where a model's files are, and how its checkpoint tensors are read.

- `resolve_model_dir`: a local folder is used as is; anything else is a hub id,
  fetched (config, tokenizer, weights) with huggingface_hub, or found in the hub cache
  when offline.
- `resolve_adapter_dir`: the same for a LoRA adapter's `lora_path` (a folder or a hub id).
- `find_weight_files`: which files of a folder hold the weights, in order of
  preference: sharded safetensors (via `model.safetensors.index.json`), any
  `*.safetensors`, then PyTorch `pytorch_model*.bin`.
- `load_hf_config`: the model's config: transformers' `AutoConfig`, except for formats
  transformers does not know that the engine reads itself (Granite Switch), and
  multimodal Gemma 3, whose text config is served.
- `iterate_weights`: `(name, tensor)` pairs, one tensor at a time. safetensors are
  opened with `safe_open` (memory-mapped; each tensor is read when asked for), so a
  checkpoint is never materialised as a whole state dict.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Optional

import torch

from vllm import envs

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_PATTERN = "*.safetensors"
PT_PATTERN = "pytorch_model*.bin"

# What a model folder needs besides weights: configs, tokenizer files, chat templates.
_METADATA_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
# Original-format copies that duplicate the HF weights (Llama's original/, Mistral's consolidated).
_IGNORE_PATTERNS = ["original/*", "consolidated*"]


def _unreachable(model: str, reason: str) -> ValueError:
    return ValueError(
        f"Model {model!r} is neither a local folder nor reachable on the Hugging Face hub ({reason}). "
        "Pass the path of a folder that holds config.json and the weights, or a hub id with network "
        "access (unset HF_HUB_OFFLINE), or download it first with `huggingface-cli download "
        f"{model}`."
    )


def resolve_model_dir(model: str, revision: Optional[str] = None, cache_dir: Optional[str] = None,
                      token: Optional[str] = None) -> str:
    """A local folder holding `model`'s config, tokenizer and weights."""
    if os.path.isdir(model):
        return model
    if model.startswith((os.sep, ".", "~")) or os.path.exists(model):
        raise ValueError(f"Model path {model!r} is not an existing folder.")
    from huggingface_hub import snapshot_download

    offline = envs.HF_HUB_OFFLINE

    def download(patterns: list[str]) -> str:
        return snapshot_download(
            model,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            allow_patterns=patterns,
            ignore_patterns=_IGNORE_PATTERNS,
            local_files_only=offline,  # offline: the hub cache only
        )

    try:
        folder = download(_METADATA_PATTERNS + [SAFETENSORS_PATTERN])
        if not glob.glob(os.path.join(folder, SAFETENSORS_PATTERN)):
            folder = download(_METADATA_PATTERNS + [PT_PATTERN])
    except Exception as e:  # huggingface_hub raises many types: offline, not found, HTTP, validation
        reason = "HF_HUB_OFFLINE is set and it is not in the hub cache" if offline else f"{type(e).__name__}: {e}"
        raise _unreachable(model, reason) from e
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise _unreachable(model, "the repository has no config.json")
    return folder


ADAPTER_PATTERNS = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "*.json"]


def resolve_adapter_dir(name: str, path: str) -> str:
    """A local folder holding the adapter at `path`: the folder itself, or a hub id
    (`org/adapter`) downloaded with huggingface_hub (the hub cache only when offline)."""
    if os.path.isdir(path):
        return path
    if path.startswith((os.sep, ".", "~")) or os.path.exists(path) or path.count("/") != 1:
        raise ValueError(f"LoRA adapter {name!r}: path {path!r} does not exist or is not a folder.")
    from huggingface_hub import snapshot_download

    offline = envs.HF_HUB_OFFLINE
    try:
        return snapshot_download(path, allow_patterns=ADAPTER_PATTERNS, local_files_only=offline)
    except Exception as e:  # huggingface_hub raises many types: offline, not found, HTTP, validation
        reason = "HF_HUB_OFFLINE is set and it is not in the hub cache" if offline else f"{type(e).__name__}: {e}"
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is neither a local folder nor reachable on the Hugging "
                         f"Face hub ({reason}).") from e


def _indexed_files(folder: str, index_name: str) -> Optional[list[str]]:
    index_path = os.path.join(folder, index_name)
    if not os.path.isfile(index_path):
        return None
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]


def find_weight_files(folder: str, load_format: str = "auto") -> tuple[list[str], str]:
    """(files, "safetensors" | "pt") for the weights in `folder`.
    `load_format`: "auto" (safetensors preferred), "safetensors" or "pt"."""
    if load_format not in ("auto", "safetensors", "pt"):
        raise ValueError(f"Unknown load_format {load_format!r}; allowed: 'auto', 'safetensors', 'pt', 'dummy'.")
    candidates = []
    if load_format in ("auto", "safetensors"):
        candidates.append(("safetensors", SAFETENSORS_INDEX, SAFETENSORS_PATTERN))
    if load_format in ("auto", "pt"):
        candidates.append(("pt", PT_INDEX, PT_PATTERN))
    for fmt, index_name, pattern in candidates:
        files = _indexed_files(folder, index_name) or sorted(glob.glob(os.path.join(folder, pattern)))
        if files:
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise ValueError(f"{index_name} in {folder!r} lists weight files that are absent: {missing}.")
            return files, fmt
    looked_for = ", ".join(f"{index_name} / {pattern}" for _, index_name, pattern in candidates)
    raise ValueError(
        f"No model weights found in {folder!r} (looked for {looked_for}). "
        "Point the model at a folder with a HF checkpoint, or use load_format='dummy' for random weights."
    )


def iterate_weights(files: list[str], fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, host tensor) pairs, streamed file by file, tensor by tensor."""
    for path in files:
        if fmt == "safetensors":
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            # mmap: tensors are paged in when copied, not read up front. The
            # map_location keeps every storage on the host whatever device saved it.
            state = torch.load(path, map_location=lambda storage, _: storage, weights_only=True, mmap=True)
            yield from state.items()
            del state


def load_hf_config(model_dir: str, trust_remote_code: bool = False):
    """The HF config of the model in `model_dir` (ValueError if it cannot be read)."""
    from transformers import AutoConfig

    from vllm.model_executor.models.gemma3 import text_only_config
    from vllm.model_executor.models.granite_switch_config import is_granite_switch, load_granite_switch_config

    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Could not read the model config {path!r}: {e}") from e
    if is_granite_switch(raw):
        return load_granite_switch_config(model_dir, raw)
    try:
        # Multimodal Gemma 3 is served as its language model (text only).
        return text_only_config(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code))
    except (OSError, ValueError) as e:
        # A config transformers cannot read is usually a remote-code architecture (e.g.
        # Phi3SmallForCausalLM): name it and what is supported rather than transformers' error.
        from vllm.model_executor.models import get_model_class

        architectures = raw.get("architectures") or []
        if architectures:
            get_model_class(architectures[0])  # raises for an unsupported one
        raise ValueError(f"Could not read the model config in {model_dir!r}: {e}") from e
