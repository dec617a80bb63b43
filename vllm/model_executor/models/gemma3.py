"""Gemma 3 text models (`Gemma3ForCausalLM`, `model_type: gemma3_text`: gemma-3-270m,
gemma-3-1b), and the language model of multimodal Gemma 3 checkpoints, served as text.

Gemma 3 is Gemma 2's four-norm decoder (vllm/model_executor/models/gemma2.py) with:

- a GemmaRMSNorm over each head of q and k before rotary (`self_attn.q_norm`,
  `self_attn.k_norm`, weight [head_dim]): the common decoder's per-head q/k norm with
  Gemma's norm class;
- no attention soft cap: transformers' Gemma 3 never applies `attn_logit_softcapping`,
  so a config that sets it is refused rather than served one way or the other; the
  final logit soft cap is applied when set (Gemma 2's `compute_logits`);
- RoPE per layer type: local (sliding-window) layers rotate with their own base
  (10k on the released checkpoints) and no scaling, global layers with `rope_theta`
  (1M) and its scaling (linear, factor 8, on the 4b/12b/27b checkpoints). One
  RotaryEmbedding, with its own cos/sin cache, per layer type.

RoPE parameters per layer type, as configs spell them:
- transformers 5: `rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}`
  (it converts older config.json files to this on load);
- transformers 4: `rope_theta` and `rope_scaling` for global layers, `rope_local_base_freq`
  for local ones (unscaled).

Multimodal checkpoints (`Gemma3ForConditionalGeneration`: gemma-3-4b/12b/27b) are served
as text-only models: `text_only_config` (called by the config loader) hands the engine
their `text_config`, and `Gemma3TextOnlyForCausalLM` loads the language model's weights
(`language_model.model.*` as released, `model.language_model.*` as transformers 5 names
them in memory) and skips the vision tower and projector. Prompts are token ids or text;
images are not accepted, so image tokens are never expanded into image embeddings.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch

from vllm.model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from vllm.model_executor.models.gemma import LAYER_TYPES, architecture_of, gemma_options
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM, Gemma2Model
from vllm.model_executor.models.llama import DecoderOptions, head_size_of

# transformers' defaults when a config gives no base (Gemma3TextConfig.default_theta).
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def layer_type_rope_parameters(config: Any, layer_type: str) -> dict:
    """The flat RoPE parameters of one layer type (see module docstring), validated and
    completed by the common `rope_parameters`."""
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"Unknown layer type {layer_type!r}; known: {', '.join(LAYER_TYPES)}.")
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        per_type = dict(params.get(layer_type) or {"rope_type": "default"})
    elif layer_type == "full_attention":  # transformers 4: rope_theta with rope_scaling
        per_type = dict(getattr(config, "rope_scaling", None) or params or {"rope_type": "default"})
        per_type.setdefault("rope_theta", getattr(config, "rope_theta", None))
    else:  # transformers 4: local layers are never scaled
        per_type = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", None)}
    if per_type.get("rope_theta") is None:
        per_type["rope_theta"] = _DEFAULT_THETA[layer_type]
    view = SimpleNamespace(rope_parameters=per_type, max_position_embeddings=config.max_position_embeddings)
    return rope_parameters(view)


class Gemma3Model(Gemma2Model):
    @classmethod
    def rotary_embeddings(cls, config: Any, dtype: torch.dtype, device: torch.device) -> dict[str, RotaryEmbedding]:
        """One rotary embedding per layer type present (global and local bases differ)."""
        return {
            layer_type: RotaryEmbedding(head_size_of(config), config.max_position_embeddings,
                                        layer_type_rope_parameters(config, layer_type), dtype, device)
            for layer_type in sorted(set(config.layer_types))
        }


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        cap = getattr(config, "attn_logit_softcapping", None)
        if cap is not None:
            raise ValueError(
                f"{architecture_of(config)}: attn_logit_softcapping={cap!r} is not supported: transformers' Gemma 3 "
                "does not apply an attention soft cap, so the checkpoint's intent is unclear (supported: null, as "
                "in every released Gemma 3; Gemma 2 applies it)."
            )
        return gemma_options(config, config.hidden_activation, attention_scale=config.query_pre_attn_scalar**-0.5,
                             qk_norm=True)


MULTIMODAL_ARCHITECTURE = "Gemma3ForConditionalGeneration"
# Checkpoint prefixes of the language model -> ours; tensors under _VISION_PREFIXES are skipped.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_only_config(config: Any) -> Any:
    """A multimodal Gemma 3 config -> its text config, under the multimodal architecture name
    (so `Gemma3TextOnlyForCausalLM` reads the checkpoint), with the top level's dtype and
    tying; any other config is returned as it is."""
    if MULTIMODAL_ARCHITECTURE not in (getattr(config, "architectures", None) or []):
        return config
    text = config.text_config
    text.architectures = [MULTIMODAL_ARCHITECTURE]
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    return text


class Gemma3TextOnlyForCausalLM(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (see module docstring)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._text_weights(weights))

    @staticmethod
    def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(_VISION_PREFIXES):
                continue
            for theirs, ours in _TEXT_PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            yield name, tensor
