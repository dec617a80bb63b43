"""Gemma (1) (`GemmaForCausalLM`), and what every Gemma generation shares.

Gemma 1 is the Llama decoder (two norms per layer, one RoPE, causal attention over the
whole context) with three differences, all shared by Gemma 2 and Gemma 3
(vllm/model_executor/models/gemma2.py, gemma3.py):

- every norm is `GemmaRMSNorm`: `x * (1 + weight)` with the product in float32
  (vllm/model_executor/layers/layernorm.py);
- the MLP is GeGLU: GELU with the tanh approximation. Gemma 1 configs written before
  transformers fixed it say `hidden_act="gelu"` and mean the tanh form; transformers
  reads them so, and so do we;
- token embeddings are multiplied by sqrt(hidden_size) *rounded to the model dtype
  first* (HF multiplies by a 0-d tensor cast to the weight's dtype), so bf16 checkpoints
  whose sqrt(hidden_size) is not a bf16 number (gemma-2-9b: 59.87 -> 60.0) match HF;
- the head is tied to the embedding unless the config says otherwise.

Invariant: the options and refusals here (`gemma_options`, `check_causal`) are the ones
Gemma 2 and 3 build on, so a config option refused for one generation is refused with
the same message for all.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM, LlamaModel

LAYER_TYPES = ("sliding_attention", "full_attention")


def embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as HF applies it: a float32 scalar cast to the model dtype. As a
    Python float it multiplies exactly as HF's 0-d tensor does (one rounding, of the product)."""
    return float(torch.tensor(hidden_size**0.5).to(dtype))


def architecture_of(config: Any) -> str:
    return (getattr(config, "architectures", None) or ["This Gemma model"])[0]


def check_causal(config: Any) -> None:
    """Gemma configs can ask for bidirectional attention (EmbeddingGemma, encoders); this
    engine generates text and attends causally only."""
    if getattr(config, "use_bidirectional_attention", None):
        raise ValueError(
            f"{architecture_of(config)}: use_bidirectional_attention=True is not supported (attention is causal; "
            "supported: use_bidirectional_attention false or unset). Bidirectional Gemma checkpoints are "
            "embedding models, not text generators."
        )


def check_layer_types(config: Any) -> None:
    """Gemma 2/3 name each layer's attention; the engine knows the two kinds transformers knows."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"{architecture_of(config)}: layer_types has {len(layer_types)} entries for "
                         f"{config.num_hidden_layers} layers (num_hidden_layers); it needs one per layer.")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"{architecture_of(config)}: layer_types {', '.join(map(repr, unknown))} are not supported. "
                         f"Supported: {', '.join(map(repr, LAYER_TYPES))}.")


def gemma_options(config: Any, hidden_act: str, **overrides: Any) -> DecoderOptions:
    """The decoder options every Gemma shares; `hidden_act` is the config field transformers
    reads for that generation (Gemma 1: hidden_act, Gemma 2/3: hidden_activation)."""
    check_causal(config)
    bias = bool(getattr(config, "attention_bias", False))
    act = "gelu_pytorch_tanh" if hidden_act == "gelu" else hidden_act  # the legacy spelling, as transformers
    return DecoderOptions(qkv_bias=bias, o_bias=bias, hidden_act=act, norm_class=GemmaRMSNorm, **overrides)


class GemmaModel(LlamaModel):
    """The Llama model with Gemma's embedding scale (rounded to the model dtype)."""

    def __init__(self, config: Any, options: DecoderOptions, dtype: torch.dtype, device: torch.device):
        super().__init__(config, options, dtype, device)
        self.embedding_multiplier = embedding_scale(config.hidden_size, dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    model_class = GemmaModel

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return gemma_options(config, config.hidden_act)
