"""Gemma 2 (`Gemma2ForCausalLM`), and the four-norm decoder Gemma 3 reuses.

On top of what every Gemma shares (vllm/model_executor/models/gemma.py: GemmaRMSNorm,
GeGLU, the embedding scale, the tied head), Gemma 2 has:

- four norms per layer: the attention and the MLP outputs are each normed again
  (`post_attention_layernorm`, `post_feedforward_layernorm`) before their residual add,
  and the MLP input has its own norm (`pre_feedforward_layernorm`). In HF terms:
      h = h + post_attn_norm(attn(input_norm(h)))
      h = h + post_ff_norm(mlp(pre_ff_norm(h)))
  We keep the vLLM residual stream of vllm/model_executor/models/llama.py (each layer
  returns (hidden, residual); the next norm called with a residual does the add), so
  the adds happen in the same order and dtype as HF's `residual + hidden_states`;
- attention scaled by `query_pre_attn_scalar ** -0.5` instead of head_dim ** -0.5;
- attention logits soft-capped (`attn_logit_softcapping`: cap * tanh(s / cap), done by
  the attention backend through the layer's AttentionVariant) and final logits
  soft-capped (`final_logit_softcapping`, here in `compute_logits`, in float32);
- layers alternating sliding-window and global attention, named by `layer_types`
  (transformers fills it in for configs that predate it); the window is the common
  decoder's `sliding_window_of_layer`.

Attention and MLP are the common decoder's `LlamaAttention` / `LlamaMLP`, so the fused
q/k/v and gate/up linears, weight loading and LoRA/aLoRA work unchanged; checkpoints
name the modules as Llama does plus the two extra norms.

Invariant: `Gemma2Model` builds one RotaryEmbedding per layer type
(`rotary_embeddings`, one shared object for Gemma 2); Gemma 3 overrides only that and
the decoder options.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vllm.attention.metadata import AttentionMetadata
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from vllm.model_executor.layers.vocab_embedding import VocabEmbedding
from vllm.model_executor.models.gemma import LAYER_TYPES, check_layer_types, embedding_scale, gemma_options
from vllm.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_size_of,
)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device, layer_index: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, options, rotary_emb, dtype, device, layer_index)
        self.mlp = LlamaMLP(config, options, dtype, device)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden]: the previous block's normed output
        residual: Optional[torch.Tensor],  # [num_tokens, hidden]; None for the first layer
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states = self.post_attention_layernorm(hidden_states)  # a fresh tensor: the add below may reuse it
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual


class Gemma2Model(LlamaModel):
    """LlamaModel's forward (scaled embedding, the layers, the final norm) over Gemma 2's
    layers and one rotary embedding per layer type."""

    def __init__(self, config: Any, options: DecoderOptions, dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)  # LlamaModel.__init__ would build Llama layers
        check_layer_types(config)
        self.embedding_multiplier = embedding_scale(config.hidden_size, dtype)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        ropes = self.rotary_embeddings(config, dtype, device)
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, options, ropes[layer_type], dtype, device, i)
            for i, layer_type in enumerate(config.layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    @classmethod
    def rotary_embeddings(cls, config: Any, dtype: torch.dtype, device: torch.device) -> dict[str, RotaryEmbedding]:
        """Layer type -> its rotary embedding. Gemma 2: one for all layers (one cos/sin cache)."""
        rope = RotaryEmbedding(head_size_of(config), config.max_position_embeddings, rope_parameters(config), dtype,
                               device)
        return dict.fromkeys(LAYER_TYPES, rope)


def soft_cap_(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(logits / cap) in place (HF's final_logit_softcapping); None: unchanged."""
    if cap is None:
        return logits
    return logits.div_(cap).tanh_().mul_(cap)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_class = Gemma2Model

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, dtype, device)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping must be positive or null, got {self.final_logit_softcapping}.")

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return gemma_options(config, config.hidden_activation, attention_scale=config.query_pre_attn_scalar**-0.5,
                             attn_soft_cap=getattr(config, "attn_logit_softcapping", None))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        return soft_cap_(super().compute_logits(hidden_states), self.final_logit_softcapping)
