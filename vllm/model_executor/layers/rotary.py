"""Rotary position embedding (rotate-half / GPT-NeoX style, as HF Llama), applied by
an explicit `positions` tensor so a flat batch of tokens from many sequences, at any
offsets, is rotated in one vectorised step.

Owns:
- reading the RoPE parameters from a HF config in both styles: transformers 5 writes
  `config.rope_parameters = {"rope_type", "rope_theta", "factor", ...}`; older configs
  carry `rope_theta` plus an optional `rope_scaling` dict (`type` or `rope_type`).
- the inverse frequencies of the "default", "linear" and "llama3" rope types, computed
  exactly as transformers does (fp32, same operation order), and a cos/sin cache over
  `max_position` positions in the model dtype (HF casts cos/sin to the input dtype too).

Invariant: positions must be < max_position (the config's max_position_embeddings).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict:
    """The config's RoPE parameters as one flat dict with at least `rope_type` and
    `rope_theta`, whichever transformers version wrote the config."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"Per-layer-type RoPE parameters are not supported (got {sorted(params)}).")
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def compute_inv_freq(head_size: int, params: dict) -> torch.Tensor:
    """[head_size // 2] fp32 inverse frequencies, as transformers' rope init functions."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported. Supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("Partial rotary embeddings (partial_rotary_factor != 1) are not supported.")
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


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


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, params: dict, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"Rotary embedding needs an even head size, got {head_size}.")
        self.head_size = head_size
        self.max_position = max_position
        self.rope_type = params["rope_type"]
        # inv_freq is computed on the host like transformers does, then the products and
        # cos/sin on `device` like transformers' forward does.
        inv_freq = compute_inv_freq(head_size, params).to(device)
        t = torch.arange(max_position, device=device, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # [max_position, head_size // 2]
        # Non-persistent buffers: derived from the config, never in checkpoints.
        self.register_buffer("cos_cache", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(dtype), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_size]; cos, sin: [num_tokens, 1, head_size // 2].
        # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), written per half.
        half = self.head_size // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous even if x is a view
        torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
        torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)
        return out

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)  # [num_tokens, 1, head_size // 2]
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.max_position}, rope_type={self.rope_type}"
