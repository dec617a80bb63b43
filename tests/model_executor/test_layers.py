"""Layers on their own: rotary frequencies against transformers' rope init functions
(both config styles), RMSNorm's fused add, fused-slice loading of `Linear`, and the
config checks of the model classes."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from vllm.model_executor.models import get_model_class
from vllm.model_executor.models.llama import LlamaForCausalLM, MistralForCausalLM

CPU = torch.device("cpu")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=32, max_position_embeddings=256)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_inv_freq_matches_transformers(kind):
    config = LlamaConfig(**SMALL, rope_parameters=dict(ROPES[kind]))
    params = rope_parameters(config)
    assert params["rope_type"] == kind
    ours = compute_inv_freq(16, params)
    if kind == "default":
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[kind](config)
    assert torch.equal(ours, theirs)


def test_legacy_rope_scaling_style():
    """transformers 4 configs: top-level rope_theta, rope_scaling with `type`."""
    legacy = types.SimpleNamespace(rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 4.0},
                                   max_position_embeddings=256)
    params = rope_parameters(legacy)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 50000.0
    assert torch.equal(compute_inv_freq(16, params), compute_inv_freq(16, ROPES["linear"]))
    plain = types.SimpleNamespace(rope_theta=1234.0, rope_scaling=None, max_position_embeddings=256)
    assert rope_parameters(plain) == {"rope_type": "default", "rope_theta": 1234.0, "partial_rotary_factor": 1.0,
                                      "max_position_embeddings": 256}
    llama3 = dict(ROPES["llama3"])
    del llama3["original_max_position_embeddings"]
    defaulted = rope_parameters(types.SimpleNamespace(rope_parameters=llama3, max_position_embeddings=256))
    assert defaulted["original_max_position_embeddings"] == 256


def test_unsupported_rope_type_is_refused():
    with pytest.raises(ValueError, match="'ntk' is not supported.*default, linear, dynamic, yarn, longrope, llama3"):
        compute_inv_freq(16, {"rope_type": "ntk", "rope_theta": 1e4, "factor": 2.0})


def test_rotary_matches_hf_apply_at_arbitrary_positions():
    config = LlamaConfig(**SMALL, rope_parameters=dict(ROPES["llama3"]))
    rope = RotaryEmbedding(16, 256, rope_parameters(config), torch.float32, CPU)
    hf_rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([200, 3, 0, 77, 31, 32])  # out of order, as in a mixed batch
    q, k = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    ours_q, ours_k = rope(positions, q, k)
    cos, sin = hf_rope(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))


def test_rmsnorm_matches_hf_and_fuses_residual_add():
    hf = LlamaRMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(hf.weight)
    norm = RMSNorm(64, 1e-6, torch.float32, CPU)
    norm.weight.data.copy_(hf.weight.data)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    x_copy = x.clone()
    # The torch path is exact; the native CPU kernel is checked against it in test_fused_norm.py.
    assert torch.equal(norm.forward_native(x), hf(x_copy))
    assert torch.equal(x, x_copy), "the plain norm must not modify its input"
    out, new_residual = norm.forward_native(x.clone(), residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, hf(x + residual))
    bf16 = RMSNorm(64, 1e-6, torch.bfloat16, CPU)
    bf16.weight.data.copy_(hf.weight.data)
    hf_bf16 = hf.to(torch.bfloat16)
    assert torch.equal(bf16.forward_native(x.bfloat16()), hf_bf16(x.bfloat16()))


def test_linear_loads_fused_slices():
    layer = Linear(8, [4, 2, 2], bias=True, dtype=torch.float32, device=CPU)
    assert (layer.input_size, layer.output_sizes, tuple(layer.weight.shape)) == (8, [4, 2, 2], (8, 8))
    parts = [torch.randn(n, 8) for n in (4, 2, 2)]
    biases = [torch.randn(n) for n in (4, 2, 2)]
    for shard, (w, b) in enumerate(zip(parts, biases)):
        layer.weight_loader(layer.weight, w, shard)
        layer.weight_loader(layer.bias, b, shard)
    assert torch.equal(layer.weight, torch.cat(parts))
    x = torch.randn(3, 8)
    assert torch.allclose(layer(x), x @ torch.cat(parts).T + torch.cat(biases))
    with pytest.raises(ValueError, match=r"expects \(2, 8\).*has \(3, 8\)"):
        layer.weight_loader(layer.weight, torch.randn(3, 8), 1)
    with pytest.raises(ValueError, match="shard 3 out of range"):
        layer.weight_loader(layer.weight, torch.randn(2, 8), 3)


def _windows(model) -> list:
    return [layer.self_attn.attn.variant.sliding_window for layer in model.model.layers]


def test_sliding_window_per_layer_as_transformers_reads_the_config():
    layers = SMALL.get("num_hidden_layers", 1)
    model = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=16), torch.float32, CPU)
    assert _windows(model) == [16] * layers  # Mistral v0.1: every layer
    # Qwen2 configs may keep sliding_window while no layer is a "sliding_attention" one.
    qwen2 = Qwen2Config(**SMALL, use_sliding_window=False)
    qwen2.sliding_window = 16
    assert _windows(get_model_class("Qwen2ForCausalLM")(qwen2, torch.float32, CPU)) == [None] * layers
    qwen2 = Qwen2Config(**{**SMALL, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=16,
                        max_window_layers=1)
    assert _windows(get_model_class("Qwen2ForCausalLM")(qwen2, torch.float32, CPU)) == [None, 16, 16]


def test_unknown_activation_and_architecture_are_refused():
    with pytest.raises(ValueError, match="MLP activation 'relu2' is not supported. Supported: silu, swish, gelu"):
        LlamaForCausalLM(LlamaConfig(**SMALL, hidden_act="relu2"), torch.float32, CPU)
    with pytest.raises(ValueError, match="Model architecture GPT2LMHeadModel is not supported. Supported: .*Granite"):
        get_model_class("GPT2LMHeadModel")


def test_module_names_and_tied_head():
    config = LlamaConfig(**{**SMALL, "num_hidden_layers": 2}, tie_word_embeddings=True)
    model = LlamaForCausalLM(config, torch.float32, CPU)
    names = {name for name, _ in model.named_parameters()}
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
            "model.layers.0.mlp.down_proj.weight", "model.norm.weight"} <= names
    assert "lm_head.weight" not in names  # shared with the embedding, listed once
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.qkv_proj.output_sizes == [64, 32, 32]
    # One rotary cos/sin cache shared by every layer, not one per layer.
    assert model.model.layers[0].self_attn.rotary_emb is model.model.layers[1].self_attn.rotary_emb


def test_onednn_packed_linear_and_lm_head_match_reference():
    """oneDNN packing is the CPU layout of fp16 weights where the CPU has them, and of fp32/bf16
    where the native GEMV is not built; the packed path is checked in fp32, which every oneDNN has."""
    from vllm.model_executor.layers.vocab_embedding import LMHead, VocabEmbedding

    cpu = torch.device("cpu")
    from vllm.platforms import onednn_packs

    if not onednn_packs(torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    torch.manual_seed(0)
    linear = Linear(48, [32, 16, 16], True, torch.float32, cpu)
    embedding = VocabEmbedding(100, 48, torch.float32, cpu)
    for p in (linear.weight, linear.bias, embedding.weight):
        torch.nn.init.normal_(p)
    head = LMHead(100, 48, torch.float32, cpu, tied_embedding=embedding)
    x = torch.randn(37, 48)
    expected_linear, expected_head = linear(x), head(x)
    linear.pack_for_onednn(batch_hint=64)
    head.pack_for_onednn(batch_hint=64)
    torch.testing.assert_close(linear(x), expected_linear, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x[::2]), expected_linear[::2], rtol=1e-5, atol=1e-4)  # strided input
    torch.testing.assert_close(head(x), expected_head, rtol=1e-5, atol=1e-4)
    assert linear.weight.numel() == 0  # no second copy kept
    assert embedding.weight.numel() == 100 * 48  # the tied embedding still embeds
