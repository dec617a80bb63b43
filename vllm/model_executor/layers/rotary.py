"""Rotary position embedding (rotate-half / GPT-NeoX style, as HF Llama and Phi-3),
applied by an explicit `positions` tensor so a flat batch of tokens from many
sequences, at any offsets, is rotated in one vectorised step.

Owns:
- reading the RoPE parameters from a HF config in both styles: transformers 5 writes
  `config.rope_parameters = {"rope_type", "rope_theta", "factor", ...}`; older configs
  carry `rope_theta` plus an optional `rope_scaling` dict (`type` or `rope_type`), and
  Phi-3 keeps `original_max_position_embeddings` and `partial_rotary_factor` at the top.
- the inverse frequencies and attention factor of every rope type in
  `SUPPORTED_ROPE_TYPES`, computed exactly as transformers' `ROPE_INIT_FUNCTIONS`
  (fp32, same operation order), and a cos/sin cache over `max_position` positions in
  the model dtype, already multiplied by the attention factor (yarn, longrope) as
  transformers multiplies cos/sin.
- partial rotary (`partial_rotary_factor`): only the first `rotary_dim` features of
  each head are rotated, the rest pass through.

Invariant: the cache is indexed by position alone, so a token's rotation never depends
on the batch it runs in, chunked prefill or a prefix-cache hit. For the two types that
transformers recomputes from the *current sequence length*, that gives:
- `dynamic` (NTK): position p uses the frequencies transformers uses for a sequence of
  length max(p + 1, max_position_embeddings). Identical to transformers' generation for
  every prompt up to max_position_embeddings and every generated token after it; the one
  difference is a prompt longer than that, whose earlier tokens transformers rotates with
  the frequencies of the whole prompt's length. (The engine caps max_model_len at
  max_position_embeddings in vllm/engine/arg_utils.py, so served requests stay below the
  point where dynamic scaling starts; the cache covers factor x the positions for when
  that cap allows more.)
- `longrope`: positions < original_max_position_embeddings use `short_factor`, later
  ones `long_factor`. Identical to transformers for every sequence that stays within
  original_max_position_embeddings, and to a transformers model fed its prompt (up to
  that length) and then one token at a time. transformers instead switches a whole
  sequence to `long_factor` once it is longer (a longer prompt is rotated entirely with
  it, and Phi-3's `generate` drops its KV cache and recomputes when a sequence crosses),
  which a cache of rotated keys cannot follow without recomputing the request.
Positions must be < max_position.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm import envs

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_parameters(config: Any) -> dict:
    """The config's RoPE parameters as one flat dict with at least `rope_type`,
    `rope_theta`, `partial_rotary_factor` and `max_position_embeddings`, whichever
    transformers version wrote the config. Unknown rope types or missing keys raise
    ValueError here, at model construction."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"Per-layer-type RoPE parameters are not supported (got {sorted(params)}).")
    rope_type = params.get("rope_type", params.get("type", "default"))
    # Early Phi-3-128k configs spell longrope "su" (as transformers 4.40 did).
    rope_type = params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported. Supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    params["max_position_embeddings"] = config.max_position_embeddings
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers: a top-level value (Phi-3) wins over the dict's.
        top_level = getattr(config, "original_max_position_embeddings", None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    missing = [key for key in _REQUIRED_KEYS.get(rope_type, ()) if params.get(key) is None]
    if missing:
        raise ValueError(f"RoPE type {rope_type!r} needs {', '.join(missing)} in the config's rope parameters.")
    return params


def rotary_dim_of(head_size: int, params: dict) -> int:
    factor = params.get("partial_rotary_factor", 1.0)
    dim = int(head_size * factor)
    if dim % 2 or not 0 < dim <= head_size:
        raise ValueError(
            f"partial_rotary_factor={factor} gives a rotary dimension of {dim} for head "
            f"size {head_size}; it must be even and in (0, {head_size}]."
        )
    return dim


def compute_inv_freq(dim: int, params: dict, seq_len: int | None = None) -> torch.Tensor:
    """[dim // 2] fp32 inverse frequencies for a rotary dimension `dim`, as transformers'
    ROPE_INIT_FUNCTIONS (seq_len as theirs: used by dynamic and longrope only)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported. Supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim // 2]
    if rope_type == "dynamic":
        return _dynamic_inv_freq(exponents, dim, params, torch.tensor([seq_len or 0]))[0]
    if rope_type == "yarn":
        return _yarn_inv_freq(exponents, dim, params)
    if rope_type == "longrope":
        return _longrope_inv_freq(exponents, params, long=bool(seq_len and seq_len > _original_max(params)))
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def attention_factor_of(params: dict) -> float:
    """The factor transformers multiplies cos and sin by (1 but for yarn and longrope)."""
    rope_type = params["rope_type"]
    if params.get("attention_factor") is not None and rope_type in ("yarn", "longrope"):
        return params["attention_factor"]
    if rope_type == "yarn":
        factor = _yarn_factor(params)
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        return get_mscale(factor)
    if rope_type == "longrope":
        orig = _original_max(params)
        factor = params.get("factor") or params["max_position_embeddings"] / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return 1.0


def _original_max(params: dict) -> int:
    return params["original_max_position_embeddings"]


def _yarn_factor(params: dict) -> float:
    # DeepSeek-V3-style configs give no factor: the context extension ratio stands in.
    return params.get("factor") or params["max_position_embeddings"] / _original_max(params)


def _dynamic_inv_freq(exponents: torch.Tensor, dim: int, params: dict, seq_lens: torch.Tensor) -> torch.Tensor:
    """[len(seq_lens), dim // 2]: NTK-scaled frequencies for each sequence length (int64
    tensor); lengths below max_position_embeddings count as it (the unscaled base)."""
    max_pos, factor = params["max_position_embeddings"], params["factor"]
    seq_lens = torch.maximum(seq_lens, torch.tensor(max_pos, dtype=seq_lens.dtype))
    base = params["rope_theta"] * ((factor * seq_lens / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # fp32
    return 1.0 / (base[:, None] ** exponents[None, :])


def _yarn_inv_freq(exponents: torch.Tensor, dim: int, params: dict) -> torch.Tensor:
    """YaRN: extrapolated (unscaled) frequencies for fast-rotating dimensions, frequencies
    divided by `factor` for slow ones, a linear ramp between beta_fast and beta_slow
    rotations over the original context."""
    base, orig, factor = params["rope_theta"], _original_max(params), _yarn_factor(params)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp  # 1: keep the original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_inv_freq(exponents: torch.Tensor, params: dict, long: bool) -> torch.Tensor:
    """LongRoPE (Phi-3): per-frequency rescale factors, `long_factor` past the original
    context and `short_factor` within it."""
    ext_factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext_factors.shape != exponents.shape:
        raise ValueError(
            f"longrope factors need {exponents.numel()} values (rotary dim / 2), got {ext_factors.numel()}."
        )
    return 1.0 / (ext_factors * params["rope_theta"] ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones
    kept, a smooth blend in between (transformers' `_compute_llama3_parameters`)."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def position_inv_freq(dim: int, params: dict, max_position: int) -> torch.Tensor:
    """[max_position or 1, dim // 2] fp32: the frequencies each position uses (see the
    module docstring); one row when they do not depend on the position."""
    rope_type = params["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "dynamic":
        seq_lens = torch.arange(1, max_position + 1, dtype=torch.int64)  # position p: length p + 1
        return _dynamic_inv_freq(exponents, dim, params, seq_lens)
    if rope_type == "longrope":
        short = _longrope_inv_freq(exponents, params, long=False)
        long = _longrope_inv_freq(exponents, params, long=True)
        is_long = torch.arange(max_position) >= _original_max(params)
        return torch.where(is_long[:, None], long[None, :], short[None, :])
    return compute_inv_freq(dim, params)[None, :]


def _native_rotary_available() -> bool:
    from vllm.attention.backends.cpu_native import rotary_kv_unavailable_reason

    return rotary_kv_unavailable_reason() is None


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of each q/k head. Runs in torch on every
    device: the Triton kernel in vllm/attention/ops/rotary.py is not on this path, so
    partial rotary and every rope type need nothing from it. On the CPU in fp32 and bf16 the
    same arithmetic runs as one native call (vllm/csrc/cpu/rotary_kv.cpp: equal to the torch
    path bit for bit) instead of about twelve small ops; `_rotate` stays the reference and
    the fallback (no compiler, VLLM_USE_TORCH_REFERENCE_OPS)."""

    def __init__(self, head_size: int, max_position: int, params: dict, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim_of(head_size, params)
        if params["rope_type"] == "dynamic":
            # Dynamic NTK exists to run past the trained context: cover factor x of it, as
            # vLLM does (the engine's max_model_len decides what is reachable).
            max_position = max(max_position, int(params["max_position_embeddings"] * params["factor"]))
        self.max_position = max_position
        self.rope_type = params["rope_type"]
        # Frequencies are computed on the host like transformers does, then the products
        # and cos/sin on `device` like transformers' forward does.
        inv_freq = position_inv_freq(self.rotary_dim, params, max_position)
        attention_factor = attention_factor_of(params)
        t = torch.arange(max_position, device=device, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq.to(device)  # [max_position, rotary_dim // 2]
        # Non-persistent buffers: derived from the config, never in checkpoints.
        self.register_buffer("cos_cache", (freqs.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * attention_factor).to(dtype), persistent=False)
        # The kernel is built (or loaded) here, while the model is built, not by the first request.
        self._native = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                        and not envs.VLLM_USE_TORCH_REFERENCE_OPS and _native_rotary_available())

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_size]; cos, sin: [num_tokens, 1, rotary_dim // 2].
        # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), written per half.
        half, rd = self.rotary_dim // 2, self.rotary_dim
        x1, x2 = x[..., :half], x[..., half:rd]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous even if x is a view
        torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
        torch.mul(x2, cos, out=out[..., half:rd]).add_(x1 * sin)
        if rd < self.head_size:
            out[..., rd:] = x[..., rd:]  # partial rotary: the rest passes through
        return out

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._native and query.dtype == key.dtype == self.cos_cache.dtype and query.stride(-1) == key.stride(-1) == 1:
            out_q = torch.empty(query.shape, dtype=query.dtype)  # [num_tokens, num_heads, head_size]
            out_k = torch.empty(key.shape, dtype=key.dtype)  # [num_tokens, num_kv_heads, head_size]
            torch.ops.vllm_rotary_kv.rotary(out_q, out_k, query, key, positions.to(torch.int64).contiguous(),
                                            self.cos_cache, self.sin_cache)
            return out_q, out_k
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)  # [num_tokens, 1, rotary_dim // 2]
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
                f"rope_type={self.rope_type}")
