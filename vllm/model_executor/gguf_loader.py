"""GGUF checkpoints (llama.cpp's single-file format) as `model`: `LLM(model="/path/model.gguf")`.

Owns: recognising a GGUF model path (`gguf_model_path`), the model's HF config read from the
file's metadata (`load_gguf_config`, through transformers; its dtype bf16 / fp16 when every layer
weight is BF16 / F16, so that dtype="auto" treats the file as such a checkpoint), and the stream of its tensors under
HF names (`iterate_gguf_weights`) in which quantized tensors stay packed: each becomes a
`QuantizedWeight` (layers/quantization.py) that `Linear` and `LMHead` keep as they are. The
tokenizer is read from the same metadata by vllm/tokenizer.py.

Block formats (a tensor row is a run of blocks; ggml's fp16 d / dmin become fp32 exactly, except
Q4_0's d, kept fp16 as stored):
  F32, F16, BF16                                   -> dense tensors
  Q8_0  blocks of 32: fp16 d, int8 q[32]            -> int8, group 32, scale d
  Q4_0  blocks of 32: fp16 d, 16 bytes of nibbles  -> int4 exactly as stored (our int4 is Q4_0's
                                                      layout: byte j = element j | element j+16 << 4)
  Q4_1  blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles; w = d*q + m, q in 0..15
                                                   -> int4 as stored, scale d and minimum m (fp16 as
                                                      stored, each row's d beside its m: the
                                                      kernel forms the offset m + 8d itself)
  Q6_K  blocks of 256: ql[128], qh[64], int8 sc[16], fp16 d; w = d*sc*q, q in -32..31
                                                   -> int8, group 16, scale d*sc (exact in fp32),
                                                      kept as d (fp32) and sc (a byte each)
  Q4_K  blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit sc / m, qs[128]; w = d*sc*q - dmin*m,
        q in 0..15                                  -> int4, group 32, scale d*sc, offset 8*d*sc - dmin*m,
                                                      kept as d, dmin (fp32) and sc, m (a byte each);
                                                      nibbles repacked from Q4_K's order into Q4_0's
Every 2-D weight stays packed, the LM head included (`output.weight`; with tied embeddings the
file has none and `token_embd.weight` serves both): the embedding's loader dequantizes its lookup
table into the model's dtype, and a tied head keeps the packed tensor as its own copy
(layers/vocab_embedding.py).

Invariants:
- A quantized weight's `dequantize()` equals gguf-py's dequantization of the same block up to the
  last fp32 bit (Q4_K's offset is rounded once), so the engine matches transformers, which
  dequantizes the file, as closely as an fp32 checkpoint.
- Llama files store q/k rows in llama.cpp's rotary order; whole rows move back (as transformers
  does on load), which permutes packed rows, scales and offsets exactly.
- Every tensor type and architecture is checked before any weight is loaded; others are refused
  naming what is supported.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch

from vllm.config import hf_num_kv_heads
from vllm.model_executor.layers.quantization import INT4_GROUP, Q6_K_GROUP, QuantizedWeight, q4_1_scales_and_mins

# transformers' model_type (from general.architecture) -> the model class that serves it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DENSE_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# llama.cpp tensor (after "blk.N.") -> HF module (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))  # slices of one Linear
# Recomputed from the config (llama3-style rope scaling factors).
_IGNORED = ("rope_freqs.weight",)


def gguf_model_path(model: str) -> Optional[str]:
    """The GGUF file `model` names, or None when `model` is not a .gguf path."""
    if not model.endswith(".gguf"):
        return None
    path = os.path.expanduser(model)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF model {model!r} is not an existing file.")
    return os.path.abspath(path)


def load_gguf_config(path: str) -> Any:
    """The HF config transformers reads from the file's metadata, naming the class that serves it."""
    from transformers import AutoConfig

    reader = _reader(path)
    architecture = _metadata(reader, path, "general.architecture")
    if architecture not in ("llama", "qwen2"):
        raise ValueError(f"GGUF file {path!r} holds a {architecture!r} model; supported GGUF architectures: "
                         "llama (Llama, Mistral), qwen2.")
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    config.architectures = [ARCHITECTURES[config.model_type]]
    config.dtype = _layers_dtype(reader)
    return config


def _layers_dtype(reader) -> Optional[torch.dtype]:
    """bf16 / fp16 when every 2-D layer weight of the file is BF16 / F16, so that dtype="auto" takes
    the file as it takes a bf16 / fp16 checkpoint (on a CPU: bf16 where it has native bf16); None for
    F32, quantized or mixed layers (then fp32, the precision llama.cpp computes activations in)."""
    kinds = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    return {frozenset({"BF16"}): torch.bfloat16, frozenset({"F16"}): torch.float16}.get(frozenset(kinds))


def _reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError, struct.error, IndexError... on a damaged file
        raise ValueError(f"{path!r} is not a readable GGUF file: {type(e).__name__}: {e}") from e


def _metadata(reader, path: str, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF file {path!r} has no {key!r} metadata.")
    return field.contents()


def iterate_gguf_weights(path: str, config: Any) -> Iterator[tuple[str, Union[torch.Tensor, QuantizedWeight]]]:
    """(HF name, dense tensor or QuantizedWeight) for every tensor of the file, one at a time."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = [t for t in reader.tensors if t.name not in _IGNORED]
    _check_types(path, tensors)
    permute = reader.fields["general.architecture"].contents() == "llama"
    heads = config.num_attention_heads
    kv_heads = hf_num_kv_heads(config)
    for t in tensors:
        rows = _rotary_rows(t.name, int(t.shape[-1]), heads, kv_heads) if permute else None
        weight = _decode(t)
        if isinstance(weight, QuantizedWeight):
            if rows is not None:
                weight = weight.rows(rows)
        elif rows is not None:
            weight = weight[rows]
        yield hf_name(t.name), weight


def _check_types(path: str, tensors: list) -> None:
    supported = DENSE_TYPES + QUANTIZED_TYPES
    kinds = {}
    for t in tensors:
        kind = t.tensor_type.name
        if kind not in supported:
            raise ValueError(f"GGUF tensor {t.name!r} in {path!r} is {kind}; supported tensor types: "
                             f"{', '.join(supported)}.")
        kinds[t.name] = kind in QUANTIZED_TYPES
    # One Linear holds a fused group: its slices may differ in block format, not be half dense.
    for name in kinds:
        layer, _, part = name.removesuffix(".weight").rpartition(".")
        for group in _FUSED:
            if name.endswith(".weight") and part == group[0]:
                slices = [f"{layer}.{p}.weight" for p in group]
                if len({kinds[s] for s in slices if s in kinds}) > 1:
                    raise ValueError(f"GGUF file {path!r}: {', '.join(slices)} mix quantized and dense tensors; "
                                     "the slices of one fused layer must be all quantized or all dense.")


def hf_name(name: str) -> str:
    """The HF (Llama-family) parameter name of a llama.cpp tensor name, e.g. blk.3.attn_q.weight."""
    stem, suffix = name.rsplit(".", 1)  # suffix: weight | bias
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    elif stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in the supported architectures "
                     f"({', '.join(ARCHITECTURES.values())}).")


def _rotary_rows(name: str, size: int, heads: int, kv_heads: int) -> Optional[torch.Tensor]:
    """Row order undoing llama.cpp's rotary permutation of q / k (per head, (pairs, 2) -> (2, pairs));
    `size`: the tensor's rows (ggml's last dimension)."""
    n = heads if ".attn_q." in name else kv_heads if ".attn_k." in name else None
    if n is None:
        return None
    return torch.arange(size).view(n, size // n // 2, 2).transpose(1, 2).reshape(-1)


def _decode(t) -> Union[torch.Tensor, QuantizedWeight]:
    """One GGUF tensor as a dense tensor (ggml's shape reversed: [rows, cols]) or a QuantizedWeight."""
    shape = [int(d) for d in reversed(t.shape.tolist())]  # ggml lists the fastest dimension first
    kind = t.tensor_type.name
    data = torch.from_numpy(np.array(t.data))  # a copy out of the memory-mapped file
    if kind in ("F32", "F16"):
        return data.reshape(shape)
    if kind == "BF16":
        return data.view(torch.int16).view(torch.bfloat16).reshape(shape)
    n, k = shape
    blocks = data.view(n, -1, _BLOCK_BYTES[kind])  # [N, blocks per row, bytes per block]
    return _DECODERS[kind](blocks, n, k)


_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}


def _half(b: torch.Tensor) -> torch.Tensor:  # [..., 2] bytes -> fp16 [...]
    return b.contiguous().view(torch.float16).squeeze(-1)


def _fp16(b: torch.Tensor) -> torch.Tensor:  # [..., 2] bytes -> fp32 [...], exactly
    return _half(b).float()


def _q8_0(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return QuantizedWeight("int8", q, _fp16(blocks[..., :2]).contiguous(), 32, k)


def _q4_0(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    # d stays fp16, as stored: the int4 kernel reads it so (4.5 bits a weight, not 5).
    return QuantizedWeight("int4", blocks[..., 2:].reshape(n, k // 2).contiguous(),
                           _half(blocks[..., :2]).contiguous(), INT4_GROUP, k)


def _q4_1(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    # d * q + m = d * (q - 8) + (m + 8d): Q4_0's nibbles and scale, and the mins as stored (fp16),
    # whose offset m + 8d the kernel forms itself: the file's 20 bytes per 32 weights.
    d, m = q4_1_scales_and_mins(_half(blocks[..., 0:2]), _half(blocks[..., 2:4]))
    return QuantizedWeight("int4", blocks[..., 4:].reshape(n, k // 2).contiguous(), d, INT4_GROUP, k, m)


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [N, blocks]
    s = blocks[..., 4:16]  # 6-bit scales and mins of the 8 sub-blocks, packed into 12 bytes
    low, mid, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([low & 63, (high & 0xF) | ((low >> 6) << 4)], dim=-1)  # [N, blocks, 8] uint8
    m = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    # qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles, 2c+1 in its high ones.
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(n, -1, 32)  # [N, K / 32, 32] in 0..15
    packed = q[..., :16] | (q[..., 16:] << 4)  # Q4_0's order: byte j = element j | element j+16 << 4
    return QuantizedWeight("int4", packed.reshape(n, k // 2).contiguous(), sc.reshape(n, -1).contiguous(),
                           INT4_GROUP, k, m.reshape(n, -1).contiguous(), torch.stack([d, dmin], dim=-1).contiguous())


def _q6_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedWeight:
    # Per half of 128 elements: element 32*i + l (i 0..3, l 0..31) takes the low 4 bits from ql
    # (byte l for i = 0, 2, byte 32 + l for i = 1, 3; low nibble for i < 2) and 2 high bits from
    # bits 2i..2i+1 of qh byte l.
    ql = blocks[..., 0:128].reshape(n, -1, 2, 2, 32)  # [N, blocks, half, i % 2, l]
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [N, blocks, half, i, l]
    high = torch.cat([(qh >> (2 * i)) & 3 for i in range(4)], dim=3)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, k)
    sc = blocks[..., 192:208].contiguous().view(torch.int8)  # [N, blocks, 16]
    d = _fp16(blocks[..., 208:210])[..., None]  # [N, blocks, 1]; a group's scale d * sc, exact
    return QuantizedWeight("int8", q.contiguous(), sc.reshape(n, -1).contiguous(), Q6_K_GROUP, k,
                           superblocks=d.contiguous())


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
