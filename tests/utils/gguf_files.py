"""Tiny GGUF files (llama.cpp's format) written in code from a tiny HF checkpoint.

`write_gguf` converts an HF folder (tests/utils/checkpoints.py) the way llama.cpp's converter
does: llama.cpp tensor names, q/k rows of Llama permuted into llama.cpp's rotary order, the
config and the test tokenizer (byte-level BPE, "gpt2" in GGUF terms) as metadata, and each
tensor stored in the type `types` picks for it. transformers reads these files back (it
dequantizes), which makes it the oracle of the engine's GGUF loader.

gguf-py quantizes F16, BF16, Q8_0 and Q4_0 itself; for Q4_K and Q6_K (which it can only
dequantize) `quantize_q4_k` and `quantize_q6_k` below are plain round-to-nearest encoders of
llama.cpp's block layouts. Their output is checked against gguf-py's dequantizer in the tests,
so a wrong layout here could not go unnoticed.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors import safe_open

# HF module (after "model.layers.N.") -> llama.cpp tensor (after "blk.N.").
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation of Llama's q/k rows: per head, rows (2, pairs) -> (pairs, 2)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:  # fp32 values -> their fp16 bytes, [..., 2]
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 -> Q4_K bytes [N, K / 256 * 144]: w ~ d*sc*q - dmin*m, q in 0..15."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32).astype(np.float32)  # [N, blocks, sub-block, 32]
    lo = np.minimum(sub.min(axis=3), 0.0)
    sub_scale, sub_min = (sub.max(axis=3) - lo) / 15, -lo
    d = (sub_scale.max(axis=2) / 63).astype(np.float16).astype(np.float32)  # as stored
    dmin = (sub_min.max(axis=2) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub_scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(sub_min / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.round((sub + (dmin[..., None] * m)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)  # [N, blocks, 8, 32]
    scales = np.concatenate([
        sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
        m[..., :4] | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4),
    ], axis=2)  # [N, blocks, 12]: the inverse of llama.cpp's get_scale_min_k4
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // 256, 128)  # sub-block 2c low, 2c+1 high
    return np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=2).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 -> Q6_K bytes [N, K / 256 * 210]: w ~ d*sc*q, q in -32..31, sc int8."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    sub_scale = np.abs(sub).max(axis=3) / 31
    d = (np.abs(sub_scale).max(axis=2) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub_scale / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
    step = d[..., None] * sc
    q = np.clip(np.round(sub / np.where(step != 0, step, 1)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # [.., half, i, l]: element 128*half + 32*i + l
    ql = np.concatenate([q[:, :, :, 0] & 0xF | ((q[:, :, :, 2] & 0xF) << 4),
                         q[:, :, :, 1] & 0xF | ((q[:, :, :, 3] & 0xF) << 4)], axis=3)  # [N, blocks, 2, 64]
    qh = sum((q[:, :, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)  # [N, blocks, 2, 32]
    return np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), _f16(d)],
                          axis=2).reshape(n, -1)


def encode(w: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.Q4_K:
        return quantize_q4_k(w)
    if qtype == T.Q6_K:
        return quantize_q6_k(w)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def _tokenizer_metadata(writer: gguf.GGUFWriter, folder: str) -> None:
    with open(os.path.join(folder, "tokenizer.json")) as f:
        spec = json.load(f)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = vocab[tok_config["eos_token"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def write_gguf(hf_dir: str, path: str, types: Callable[[str, np.ndarray], T], name: str = "tiny") -> str:
    """Write `hf_dir`'s Llama/Qwen2 checkpoint as the GGUF `path`; `types(gguf_name, weight)` picks each
    2-D weight's type (1-D tensors are F32, as llama.cpp stores them)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1e4))
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
    _tokenizer_metadata(writer, hf_dir)
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
        for hf_name in f.keys():
            w = f.get_tensor(hf_name).to(torch.float32).numpy()
            name_ = gguf_name(hf_name)
            if arch == "llama" and name_.endswith("attn_q.weight"):
                w = _permute_rotary(w, heads)
            elif arch == "llama" and name_.endswith("attn_k.weight"):
                w = _permute_rotary(w, kv_heads)
            qtype = types(name_, w) if w.ndim == 2 else T.F32
            writer.add_tensor(name_, encode(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
