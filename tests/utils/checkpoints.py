"""Tiny random HF checkpoints of every supported architecture, written with
transformers' `save_pretrained` (safetensors) next to the test tokenizer.

Weights use a large `initializer_range` so next-token distributions are peaked:
greedy comparisons against transformers are then decided by clear margins rather
than by float rounding.
"""

from __future__ import annotations

import os

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GenerationConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeHybridConfig,
    GraniteMoeSharedConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.utils.tokenizer import save_tokenizer

TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)

ARCHITECTURES = ("llama", "llama3_tied", "mistral", "mistral_window", "granite", "granite4", "granite4_nope", "qwen2",
                 "qwen2_window", "qwen3", "mixtral", "qwen3_moe", "granitemoe", "granitemoe_shared", "phi3",
                 "olmoe", "granite4_moe", "gpt_oss", "gemma", "gemma2",
                 "gemma3")

# Windows shorter than most test prompts, and not a multiple of any block size used, so
# sequences run past them inside a block and across chunk boundaries.
TEST_WINDOW = 11


def _config(arch: str, vocab_size: int, eos: int):
    ids = dict(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if arch == "llama":
        return LlamaConfig(**TINY_SHAPE, **ids)
    if arch == "llama3_tied":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return LlamaConfig(**TINY_SHAPE, **ids, tie_word_embeddings=True, rope_scaling=rope, rope_theta=500000.0)
    if arch == "mistral":
        return MistralConfig(**TINY_SHAPE, **ids, sliding_window=None, head_dim=16)
    if arch == "mistral_window":  # Mistral-7B-v0.1: one window for every layer
        return MistralConfig(**TINY_SHAPE, **ids, sliding_window=TEST_WINDOW, head_dim=16)
    if arch == "granite":
        return GraniteConfig(**TINY_SHAPE, **ids, embedding_multiplier=2.0, attention_multiplier=0.2,
                             residual_multiplier=0.5, logits_scaling=0.5, tie_word_embeddings=True)
    if arch in ("granite4", "granite4_nope"):
        # Dense Granite 4 (granite-4.0-micro shape): attention layers only, no experts, a
        # shared MLP whose size differs from intermediate_size, untied head.
        return GraniteMoeHybridConfig(
            **{**TINY_SHAPE, "intermediate_size": 512}, **ids, shared_intermediate_size=96, num_local_experts=0,
            layer_types=["attention"] * TINY_SHAPE["num_hidden_layers"],
            position_embedding_type="rope" if arch == "granite4" else None,
            embedding_multiplier=3.0, attention_multiplier=0.15, residual_multiplier=0.4, logits_scaling=2.0,
            tie_word_embeddings=False,
        )
    if arch == "qwen2":
        return Qwen2Config(**TINY_SHAPE, **ids, tie_word_embeddings=False)
    if arch == "qwen2_window":  # use_sliding_window: layers from max_window_layers on slide
        return Qwen2Config(**TINY_SHAPE, **ids, use_sliding_window=True, sliding_window=TEST_WINDOW,
                           max_window_layers=1, tie_word_embeddings=False)
    if arch == "qwen3":
        return Qwen3Config(**TINY_SHAPE, **ids, head_dim=32, tie_word_embeddings=False)
    # Mixture of experts, top-2 of 4: every routing variant (Mixtral renormalises the top-k
    # softmax, Qwen3-MoE without norm_topk_prob does not, GraniteMoe softmaxes the top-k logits)
    # and a Qwen3-MoE dense layer (mlp_only_layers) next to a sparse one.
    if arch == "mixtral":
        return MixtralConfig(**TINY_SHAPE, **ids, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**TINY_SHAPE, **ids, head_dim=32, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                              tie_word_embeddings=False)
    if arch == "granitemoe":
        return GraniteMoeConfig(**TINY_SHAPE, **ids, num_local_experts=4, num_experts_per_tok=2,
                                embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5,
                                logits_scaling=0.5, tie_word_embeddings=True)
    if arch == "granitemoe_shared":
        return GraniteMoeSharedConfig(**TINY_SHAPE, **ids, num_local_experts=4, num_experts_per_tok=2,
                                      shared_intermediate_size=96, embedding_multiplier=2.0,
                                      attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=0.5)
    if arch == "olmoe":
        # Full-width q/k norm; clip_qkv small enough that the clamp changes the logits. Here and
        # below, values chosen so greedy decoding of the parity prompts never picks EOS (the
        # reference masks it with min_new_tokens; ignore_eos does not).
        return OlmoeConfig(**TINY_SHAPE, **ids, num_experts=4, num_experts_per_tok=2, clip_qkv=0.8,
                           norm_topk_prob=False, tie_word_embeddings=False)
    if arch == "granite4_moe":
        # Granite 4 with experts next to the shared MLP, attention layers only.
        return GraniteMoeHybridConfig(
            **TINY_SHAPE, **ids, shared_intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["attention"] * TINY_SHAPE["num_hidden_layers"], position_embedding_type="rope",
            embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.4, logits_scaling=2.0,
            tie_word_embeddings=False,
        )
    if arch == "gpt_oss":
        # Sliding then full attention, sinks, attention/router/expert biases (made non-zero in
        # make_checkpoint), YaRN over an original context of 64, a SwiGLU clamp (limit 3) that binds.
        yarn = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 150000.0}
        return GptOssConfig(**TINY_SHAPE, **ids, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=TEST_WINDOW, layer_types=["sliding_attention", "full_attention"],
                            rope_parameters=yarn, swiglu_limit=3.0, tie_word_embeddings=False)
    if arch.startswith("gemma"):
        # head_dim (32) != hidden / heads and query_pre_attn_scalar (24) != head_dim, as on the
        # bigger Gemmas; windows on Gemma 2/3's sliding layers, a layer of each kind.
        gemma = dict(**TINY_SHAPE, **ids, head_dim=32)
        if arch == "gemma":
            return GemmaConfig(**gemma)
        gemma.update(query_pre_attn_scalar=24, sliding_window=TEST_WINDOW)
        if arch == "gemma2":  # both soft caps small enough to change the results
            return Gemma2Config(**gemma, attn_logit_softcapping=4.0, final_logit_softcapping=8.0)
        # Gemma 3: sliding, global, sliding; the global RoPE scaled (linear x8, 4b-27b style)
        # and its base unlike the local one.
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
        gemma.update(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        return Gemma3TextConfig(**gemma, rope_parameters=rope)
    if arch == "phi3":
        # Phi-4-mini shape: longrope with an original context (64) that every test sequence
        # stays within (past it transformers re-rotates whole sequences, see
        # vllm/model_executor/layers/rotary.py; tests/model_executor/test_phi3.py covers it),
        # 3/4 of each head rotated (6 frequencies), tied embeddings, fused qkv / gate_up tensors.
        longrope = {"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
        return Phi3Config(**TINY_SHAPE, **ids, original_max_position_embeddings=64, partial_rotary_factor=0.75,
                          rope_scaling=longrope, sliding_window=None, tie_word_embeddings=True)
    raise ValueError(f"unknown test architecture {arch!r}; known: {ARCHITECTURES}")


def make_checkpoint(path: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Write a tiny random `arch` checkpoint plus the test tokenizer into `path`."""
    os.makedirs(path, exist_ok=True)
    tok = save_tokenizer(path)
    config = _config(arch, len(tok), tok.eos_token_id)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch.startswith("gemma"):  # transformers zero-inits Gemma's (1 + weight) norms: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
    if arch == "gpt_oss":  # transformers zero-initialises the attention and expert biases
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(std=config.initializer_range)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                     pad_token_id=tok.eos_token_id).save_pretrained(path)
    return path


def load_hf_model(path: str):
    """The transformers reference model for a checkpoint (fp32, eval mode), in transformers' default
    attention but for an attention-logit soft cap (Gemma 2): eager attention, the implementation
    that applies it (transformers 5.17 picked SDPA for Gemma 2 and dropped the cap)."""
    soft_cap = getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None)
    kwargs = {"attn_implementation": "eager"} if soft_cap else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def hf_config(path: str):
    return AutoConfig.from_pretrained(path)
