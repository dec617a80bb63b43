"""Llama-family decoder (Llama, Mistral), and the parameterised decoder that Granite
and Qwen reuse.

Every variant is this same network; what differs is captured in `DecoderOptions`
(biases, per-head q/k norm, attention scale, Granite's multipliers), which each model
class derives from its HF config in `decoder_options`.

Data layout: the batch is one flat run of tokens (`[num_tokens, hidden]`, no padding
between sequences); `positions` gives each token's position in its sequence and
`AttentionMetadata` how tokens map to sequences and KV-cache slots.

Residual stream (vLLM style): each layer returns (hidden, residual) and the next
RMSNorm does the add, `residual = hidden + residual`, so the sums happen in the same
order and dtype as HF's `residual + hidden_states`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.attention.layer import Attention
from vllm.attention.metadata import AttentionMetadata
from vllm.attention.variant import AttentionVariant
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.decode_layer import NativeDecodeLayer, NativeDecodeStack
from vllm.model_executor.layers.decode_layer import runs as native_runs
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import Linear, default_weight_loader
from vllm.model_executor.layers.rotary import RotaryEmbedding, rope_parameters
from vllm.model_executor.layers.tensor_parallel import column_shard, head_shard, row_shard
from vllm.model_executor.layers.vocab_embedding import LMHead, VocabEmbedding
from vllm.model_executor.weight_mapping import load_checkpoint_weights


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    qk_norm_full_width: bool = False  # RMSNorm over all of q and all of k instead (OLMoE, OLMo 2)
    clip_qkv: Optional[float] = None  # q, k, v clamped to [-clip_qkv, clip_qkv] after any q/k norm (OLMoE)
    attn_soft_cap: Optional[float] = None  # attention logit soft-capping (Gemma 2)
    attention_sinks: bool = False  # a learned sink logit per query head (gpt-oss), `self_attn.sinks`
    hidden_act: Optional[str] = None  # None: the config's hidden_act (or hidden_activation)
    attention_scale: Optional[float] = None  # None: head_size ** -0.5
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # scales each block's output before the residual add
    logits_scaling: float = 1.0  # logits are divided by it
    rope: bool = True  # False: no positional encoding in attention (NoPE)
    intermediate_size: Optional[int] = None  # None: the config's intermediate_size
    norm_class: type[RMSNorm] = RMSNorm  # every norm, q/k norms included (Gemma: GemmaRMSNorm)
    # (config, options, layer_index, dtype, device) -> that layer's MLP (e.g. mixture of
    # experts); None: LlamaMLP everywhere.
    mlp_factory: Optional[Callable[..., nn.Module]] = None


def head_size_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of_layer(config: Any, layer_index: int) -> Optional[int]:
    """The layer's attention window, as transformers reads the config: `layer_types` names
    each layer "sliding_attention" or "full_attention" when present (Gemma, Qwen2/3 with
    `use_sliding_window`, gpt-oss); otherwise `sliding_window` holds for every layer
    (Mistral v0.1, Phi-3-mini-4k). None: the layer sees the whole context."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


# Gated-MLP activations by their HF config names (`hidden_act` / `hidden_activation`).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # Gemma's GeGLU
    "gelu_new": partial(F.gelu, approximate="tanh"),
}


def activation_of(config: Any, options: DecoderOptions) -> Callable[[torch.Tensor], torch.Tensor]:
    name = options.hidden_act or getattr(config, "hidden_activation", None) or config.hidden_act
    if name not in ACTIVATIONS:
        raise ValueError(f"MLP activation {name!r} is not supported. Supported: {', '.join(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.act = activation_of(config, options)
        # SiLU's gate product as one op (the native kernel on the CPU); other activations as two.
        self.act_and_mul = SiluAndMul(dtype, device) if self.act is F.silu else None
        hidden, inter = config.hidden_size, options.intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(hidden, [inter, inter], options.mlp_bias, dtype, device,
                                   shard=column_shard([inter, inter], "the MLP's intermediate size"))
        self.down_proj = Linear(inter, [hidden], options.mlp_bias, dtype, device,
                                shard=row_shard(inter, "the MLP's intermediate size"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return self.down_proj(self.act(gate).mul_(up))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        rotary_emb: Optional[RotaryEmbedding],
        dtype: torch.dtype,
        device: torch.device,
        layer_index: int = 0,
    ):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_size = head_size_of(config)
        heads = head_shard(total_heads, total_kv_heads, self.head_size)  # this rank's heads
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        full_q, full_kv = total_heads * self.head_size, total_kv_heads * self.head_size
        self.qkv_proj = Linear(hidden, [full_q, full_kv, full_kv], options.qkv_bias, dtype, device, shard=heads.qkv)
        self.o_proj = Linear(full_q, [hidden], options.o_bias, dtype, device, shard=heads.o)
        if options.qk_norm_full_width and heads.qkv is not None:
            raise ValueError("tensor parallelism does not support q/k norms over the full width of all heads "
                             "(OLMo 2 style); use tensor_parallel_size=1 for this model.")
        self.qk_norm = options.qk_norm or options.qk_norm_full_width
        if self.qk_norm:
            q_width, k_width = (self.q_size, self.kv_size) if options.qk_norm_full_width else (self.head_size,) * 2
            self.q_norm = options.norm_class(q_width, config.rms_norm_eps, dtype, device)
            self.k_norm = options.norm_class(k_width, config.rms_norm_eps, dtype, device)
        self.clip_qkv = options.clip_qkv
        self.rotary_emb = rotary_emb  # None: NoPE
        scale = options.attention_scale if options.attention_scale is not None else self.head_size**-0.5
        sinks = None
        if options.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=dtype, device=device), requires_grad=False)
            if heads.qkv is not None:  # this rank's heads' sinks
                first_head = heads.first_head
                self.sinks.weight_loader = lambda param, loaded, shard_id=None: default_weight_loader(
                    param, loaded.narrow(0, first_head, param.shape[0]), shard_id)
            sinks = self.sinks
        variant = AttentionVariant(sliding_window=sliding_window_of_layer(config, layer_index),
                                   soft_cap=options.attn_soft_cap, sinks=sinks)
        self.attn = Attention(self.num_heads, self.head_size, scale, self.num_kv_heads, device, variant)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # per head or full width, as the norm was built
            q = self.q_norm(q.reshape(n, -1, self.q_norm.hidden_size))
            k = self.k_norm(k.reshape(n, -1, self.k_norm.hidden_size))
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(n, self.num_heads, self.head_size)  # [num_tokens, num_heads, head_size]
        k = k.reshape(n, self.num_kv_heads, self.head_size)  # [num_tokens, num_kv_heads, head_size]
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, kv_cache, attn_metadata)  # [num_tokens, q_size]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        rotary_emb: Optional[RotaryEmbedding],
        dtype: torch.dtype,
        device: torch.device,
        layer_index: int = 0,
    ):
        super().__init__()
        self.residual_multiplier = options.residual_multiplier
        self.self_attn = LlamaAttention(config, options, rotary_emb, dtype, device, layer_index)
        if options.mlp_factory is not None:
            self.mlp = options.mlp_factory(config, options, layer_index, dtype, device)
        else:
            self.mlp = LlamaMLP(config, options, dtype, device)
        self.input_layernorm = options.norm_class(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = options.norm_class(config.hidden_size, config.rms_norm_eps, dtype, device)
        # Few-row CPU forwards as one native call where the layer qualifies (layers/decode_layer.py),
        # decided at the first such forward, when the weights are in place. False: always Python.
        self.native_decode_allowed = True
        self._native_decode: Optional[NativeDecodeLayer] = None
        self._native_decode_built = False

    def _native_decode_layer(self) -> Optional[NativeDecodeLayer]:
        if not self._native_decode_built:
            self._native_decode = NativeDecodeLayer.build(self)
            self._native_decode_built = True
        return self._native_decode

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
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
        if self.residual_multiplier != 1.0:
            hidden_states.mul_(self.residual_multiplier)  # a fresh o_proj output: safe in place
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if self.residual_multiplier != 1.0:
            hidden_states.mul_(self.residual_multiplier)
        return hidden_states, residual


class LlamaModel(nn.Module):
    # First layer -> one native call for a run of layers (layers/decode_layer.py), found at the
    # first CPU forward, when the weights are in place (a class default: subclasses that build
    # their own layers skip __init__).
    _native_runs: Optional[dict[int, NativeDecodeStack]] = None

    def __init__(self, config: Any, options: DecoderOptions, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.embedding_multiplier = options.embedding_multiplier
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        # One cos/sin cache for all layers: at 128k positions it is tens of MB.
        rotary_emb = None
        if options.rope:
            rotary_emb = RotaryEmbedding(
                head_size_of(config), config.max_position_embeddings, rope_parameters(config), dtype, device
            )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, rotary_emb, dtype, device, layer_index=i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = options.norm_class(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden_states.mul_(self.embedding_multiplier)  # F.embedding returns a fresh tensor
        if self._native_runs is None and hidden_states.is_cpu:
            self._native_runs = native_runs(self.layers)
        stacks = self._native_runs if hidden_states.is_cpu else {}
        residual = None
        assert len(kv_caches) == len(self.layers)
        i = 0
        while i < len(self.layers):
            stack = stacks.get(i)
            if stack is not None and stack.takes(hidden_states, residual, attn_metadata):
                hidden_states, residual = stack(positions, hidden_states, residual, kv_caches[i:i + len(stack)],
                                                attn_metadata)
                i += len(stack)
                continue
            hidden_states, residual = self.layers[i](positions, hidden_states, residual, kv_caches[i], attn_metadata)
            i += 1
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    model_class: type[nn.Module] = LlamaModel  # (config, options, dtype, device); Gemma 2/3 bring their own

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = hf_config
        options = self.decoder_options(hf_config)
        self.logits_scaling = options.logits_scaling
        self.model = self.model_class(hf_config, options, dtype, device)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(
            hf_config.vocab_size,
            hf_config.hidden_size,
            dtype,
            device,
            tied_embedding=self.model.embed_tokens if self.tie_word_embeddings else None,
        )

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer: [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        logits = self.lm_head(hidden_states).float()
        if self.logits_scaling != 1.0:
            logits.div_(self.logits_scaling)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # With tied embeddings the head is the embedding; a stored copy is redundant.
        ignored = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_checkpoint_weights(self, weights, self.packed_modules_mapping, ignored_names=ignored)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama without biases; v0.1's 4096-position sliding window holds for every
    layer (`sliding_window_of_layer`)."""
