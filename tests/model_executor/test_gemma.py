"""Gemma 2 and Gemma 3 beyond the shared parity suites (which run gemma, gemma2 and gemma3
through tests/model_executor/test_models.py and tests/engine/test_parity.py): Gemma's
norm and embedding numerics in bf16 against transformers' modules, PEFT LoRA and aLoRA,
prefix-cache hits past the sliding window, Gemma 3's RoPE as transformers 4 configs spell
it, multimodal Gemma 3 checkpoints served as text, and refusals."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForImageTextToText, Gemma3Config, SiglipVisionConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm, Gemma2TextScaledWordEmbedding

from tests.conftest import INVOCATION
from tests.lora.conftest import check_against_reference, generate_one
from tests.model_executor.configs import model_config_for
from tests.model_executor.paged import PagedRunner
from tests.utils.adapters import ALL_LINEAR, load_peft_model, make_adapter
from tests.utils.checkpoints import TEST_WINDOW, hf_config, load_hf_model
from tests.utils.reference import hf_greedy
from tests.utils.tokenizer import save_tokenizer
from vllm import LLM
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.vocab_embedding import VocabEmbedding
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.gemma import embedding_scale
from vllm.model_executor.models.gemma3 import layer_type_rope_parameters

CPU = torch.device("cpu")
MAX_NEW = 10
GEMMAS = ["gemma2", "gemma3"]
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 4  # several windows of 11 tokens


@pytest.mark.parametrize("hidden_size", [64, 3584])  # 3584 (gemma-2-9b): sqrt is 59.87, 59.75 in bf16
def test_norm_and_embedding_match_transformers_in_bf16(hidden_size):
    torch.manual_seed(0)
    x = torch.randn(5, hidden_size).to(torch.bfloat16)
    weight = torch.randn(hidden_size).to(torch.bfloat16)
    ours = GemmaRMSNorm(hidden_size, 1e-6, torch.bfloat16, CPU)
    theirs = Gemma2RMSNorm(hidden_size, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x.clone()), theirs(x))
        residual = torch.randn(5, hidden_size).to(torch.bfloat16)
        out, summed = ours(x.clone(), residual)
        assert torch.equal(summed, residual + x) and torch.equal(out, theirs(residual + x))

        ids = torch.tensor([0, 3, 7, 3])
        embed = VocabEmbedding(8, hidden_size, torch.bfloat16, CPU)
        embed.weight.copy_(torch.randn(8, hidden_size))
        hf_embed = Gemma2TextScaledWordEmbedding(8, hidden_size, 0, embed_scale=hidden_size**0.5).to(torch.bfloat16)
        hf_embed.weight.copy_(embed.weight)
        assert torch.equal(embed(ids).mul_(embedding_scale(hidden_size, torch.bfloat16)), hf_embed(ids))


@pytest.fixture(scope="module")
def gemma_adapters(checkpoints, tmp_path_factory, tokenizer):
    """arch -> {"lora": attention + MLP LoRA, "alora": an aLoRA}, written by PEFT."""
    root = tmp_path_factory.mktemp("gemma_adapters")
    inv = tokenizer.encode(INVOCATION, add_special_tokens=False)
    return {
        arch: {
            "lora": make_adapter(checkpoints[arch], str(root / f"{arch}_lora"), ALL_LINEAR, r=8, seed=41),
            "alora": make_adapter(checkpoints[arch], str(root / f"{arch}_alora"), ["q_proj", "v_proj", "down_proj"],
                                  r=4, seed=42, invocation_tokens=inv),
        }
        for arch in GEMMAS
    }


@pytest.fixture(scope="module")
def gemma_llms(checkpoints):
    """arch -> one LLM with LoRA, aLoRA and prefix caching (blocks of 4: many per window)."""
    return {arch: LLM(checkpoints[arch], max_model_len=256, enable_lora=True, enable_activated_lora=True,
                      max_loras=2, max_lora_rank=8, block_size=4, enable_prefix_caching=True)
            for arch in GEMMAS}


@pytest.mark.parametrize("arch", GEMMAS)
def test_lora_on_attention_and_mlp_matches_peft(arch, gemma_llms, gemma_adapters, tokenizer, checkpoints):
    peft = load_peft_model(checkpoints[arch], gemma_adapters[arch]["lora"])
    request = LoRARequest(f"{arch}_lora", 1, gemma_adapters[arch]["lora"])
    for text in ["What is the capital of France?", LONG_TEXT]:
        ids = tokenizer.encode(text)
        check_against_reference(generate_one(gemma_llms[arch], ids, request), hf_greedy(peft, ids, MAX_NEW))


@pytest.mark.parametrize("arch", GEMMAS)
def test_alora_matches_peft_and_reuses_base_blocks(arch, gemma_llms, gemma_adapters, tokenizer, checkpoints):
    llm = gemma_llms[arch]
    conversation = tokenizer.encode("Please answer the question using the documents provided. " * 3)
    generate_one(llm, conversation)  # the base model's turn fills the cache
    ids = conversation + tokenizer.encode(INVOCATION, add_special_tokens=False)
    out = generate_one(llm, ids, LoRARequest(f"{arch}_alora", 2, gemma_adapters[arch]["alora"]))
    assert out.num_cached_tokens > TEST_WINDOW  # base blocks before the invocation, past a window
    peft = load_peft_model(checkpoints[arch], gemma_adapters[arch]["alora"])
    check_against_reference(out, hf_greedy(peft, ids, MAX_NEW))


@pytest.mark.parametrize("arch", GEMMAS)
def test_prefix_cache_hit_past_the_window_gives_the_cold_tokens(arch, gemma_llms, tokenizer, checkpoints):
    llm = gemma_llms[arch]
    ids = tokenizer.encode("one two three four five six seven eight nine ten eleven twelve " * 3)
    assert len(ids) > 3 * TEST_WINDOW
    cold = generate_one(llm, ids)
    warm = generate_one(llm, ids)
    assert warm.num_cached_tokens >= len(ids) - 4  # every full block of the prompt
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    check_against_reference(warm, hf_greedy(load_hf_model(checkpoints[arch]), ids, MAX_NEW))


def _edited_copy(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _logits(path: str) -> torch.Tensor:
    config = model_config_for(path)
    model = get_model(config, CPU)
    ids = torch.arange(3, 40)
    return PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_size).step([("a", ids)])["a"]


def test_gemma3_rope_in_transformers4_spelling(checkpoints, tmp_path):
    """rope_theta + rope_scaling (global) and rope_local_base_freq (local), as Gemma 3's
    released config.json files say it, give the model the transformers 5 spelling gives."""
    def to_v4(config):
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope["full_attention"]["rope_theta"]
        config["rope_scaling"] = {"rope_type": "linear", "factor": rope["full_attention"]["factor"]}
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]

    path = _edited_copy(checkpoints["gemma3"], str(tmp_path / "v4"), to_v4)
    torch.testing.assert_close(_logits(path), _logits(checkpoints["gemma3"]), atol=0, rtol=0)

    # A config object that kept the old attributes (no per-layer-type dict) reads the same.
    v5 = hf_config(checkpoints["gemma3"])
    old = SimpleNamespace(rope_parameters=None, rope_scaling={"type": "linear", "factor": 8.0}, rope_theta=1e6,
                          rope_local_base_freq=1e4, max_position_embeddings=v5.max_position_embeddings)
    for layer_type in ("sliding_attention", "full_attention"):
        ours, theirs = layer_type_rope_parameters(old, layer_type), layer_type_rope_parameters(v5, layer_type)
        assert {k: ours.get(k) for k in ("rope_type", "rope_theta", "factor")} == {
            k: theirs.get(k) for k in ("rope_type", "rope_theta", "factor")}


def _tiny_multimodal_gemma3(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    tok = save_tokenizer(path)
    eos, vocab = tok.eos_token_id, len(tok) + 3  # + image, begin- and end-of-image tokens
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=24, max_position_embeddings=256, initializer_range=0.2,
        vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, sliding_window=TEST_WINDOW,
        layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision,
                          mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 3,
                          eoi_token_index=vocab - 2, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return path


def test_multimodal_gemma3_is_served_as_its_language_model(tmp_path, tokenizer):
    path = _tiny_multimodal_gemma3(str(tmp_path / "mm"))
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Gemma3ForConditionalGeneration"]
    llm = LLM(path, max_model_len=128)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    for text in ["What is the capital of France?", LONG_TEXT]:
        ids = tokenizer.encode(text)
        check_against_reference(generate_one(llm, ids), hf_greedy(hf, ids, MAX_NEW))


@pytest.mark.parametrize("arch, change, message", [
    ("gemma3", {"attn_logit_softcapping": 50.0},
     r"Gemma3ForCausalLM: attn_logit_softcapping=50.0 is not supported: transformers' Gemma 3 does not apply"),
    ("gemma2", {"use_bidirectional_attention": True},
     r"Gemma2ForCausalLM: use_bidirectional_attention=True is not supported \(attention is causal"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]},
     r"layer_types 'chunked_attention' are not supported. Supported: 'sliding_attention', 'full_attention'"),
    ("gemma3", {"layer_types": ["sliding_attention", "full_attention"]},
     r"layer_types has 2 entries for 3 layers \(num_hidden_layers\)"),
    ("gemma2", {"final_logit_softcapping": -1.0}, r"final_logit_softcapping must be positive or null, got -1.0"),
])
def test_unsupported_config_is_refused(arch, change, message, checkpoints):
    config = model_config_for(checkpoints[arch])
    for key, value in change.items():  # on the loaded config: transformers validates some fields on load
        setattr(config.hf_config, key, value)
    with pytest.raises(ValueError, match=message):
        get_model(config, CPU)
