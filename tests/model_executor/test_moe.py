"""Mixture-of-experts models beyond the shared parity suites (which run Mixtral,
Qwen3-MoE and GraniteMoe through tests/model_executor/test_models.py and
tests/engine/test_parity.py): checkpoint layouts, refusals, and adapters on the
attention and dense layers of an MoE model against PEFT."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora.conftest import check_against_reference, generate_one
from tests.model_executor.configs import model_config_for
from tests.model_executor.paged import PagedRunner
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.checkpoints import load_hf_model
from tests.utils.reference import hf_greedy
from vllm import LLM
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader import get_model

CPU = torch.device("cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _logits(path: str, model=None) -> torch.Tensor:
    config = model_config_for(path)
    model = model or get_model(config, CPU)
    ids = torch.arange(3, 40)
    return PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_size).step([("a", ids)])["a"]


def _copy_with_weights(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file(edit(weights), os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_expert_layout_loads_like_per_expert(arch, checkpoints):
    """transformers 5's in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H]) loads
    into the same model as the per-expert tensors save_pretrained writes."""
    hf = load_hf_model(checkpoints[arch])
    names = list(hf.state_dict())
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in names)
    model = get_model(model_config_for(checkpoints[arch], load_format="dummy"), CPU)
    model.load_weights(hf.state_dict().items())
    torch.testing.assert_close(_logits(checkpoints[arch], model), _logits(checkpoints[arch]), atol=0, rtol=0)


def test_missing_expert_is_named(checkpoints, tmp_path):
    def drop(weights):
        return {k: v for k, v in weights.items() if "experts.2.w3" not in k}

    path = _copy_with_weights(checkpoints["mixtral"], str(tmp_path / "m"), drop)
    with pytest.raises(ValueError, match=r"mlp\.experts\.w13\.weight \(slices experts\.2\.w3\)"):
        get_model(model_config_for(path), CPU)


@pytest.mark.parametrize("field, value, match", [
    ("scoring_func", "sigmoid", "scoring_func='sigmoid' is not supported"),
    ("n_group", 8, "n_group=8 is not supported"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
])
def test_unsupported_config_option_is_refused(field, value, match, checkpoints, tmp_path):
    path = str(tmp_path / "m")
    shutil.copytree(checkpoints["mixtral"], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config[field] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=match):
        get_model(model_config_for(path), CPU)


@pytest.fixture(scope="module")
def moe_adapters(checkpoints, tmp_path_factory, tokenizer):
    from tests.conftest import INVOCATION

    root = tmp_path_factory.mktemp("moe_adapters")
    inv = tokenizer.encode(INVOCATION, add_special_tokens=False)
    return {
        # Attention only: on these model types PEFT turns any gate_proj/up_proj/down_proj target
        # (list or regex) into expert-parameter targets, which are refused (test below).
        "mixtral_attn": make_adapter(checkpoints["mixtral"], str(root / "mixtral_attn"), ATTENTION, r=8, seed=31),
        "qwen3_moe_alora": make_adapter(checkpoints["qwen3_moe"], str(root / "qwen3_moe_alora"), ATTENTION, r=8,
                                        seed=32, invocation_tokens=inv),
        # GraniteMoeShared: attention and the shared-experts MLP (a dense MLP, PEFT's names aliased).
        "granitemoe_shared": make_adapter(checkpoints["granitemoe_shared"], str(root / "granitemoe_shared"),
                                          r".*\.(q_proj|v_proj|shared_mlp\.input_linear|shared_mlp\.output_linear)",
                                          r=8, seed=33),
    }


def test_lora_on_attention_of_mixtral_matches_peft(checkpoints, moe_adapters, tokenizer):
    base, adapter = checkpoints["mixtral"], moe_adapters["mixtral_attn"]
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_batched_tokens=24)
    peft = load_peft_model(base, adapter)
    request = LoRARequest("mixtral_attn", 1, adapter)
    for text in ["What is the capital of France?", "one two three four five six seven eight " * 3]:
        ids = tokenizer.encode(text)
        check_against_reference(generate_one(llm, ids, request), hf_greedy(peft, ids, 10))


def test_lora_on_shared_experts_mlp_matches_peft(checkpoints, moe_adapters, tokenizer):
    base, adapter = checkpoints["granitemoe_shared"], moe_adapters["granitemoe_shared"]
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8)
    ids = tokenizer.encode("What is the capital of France?")
    check_against_reference(generate_one(llm, ids, LoRARequest("shared", 1, adapter)),
                            hf_greedy(load_peft_model(base, adapter), ids, 10))


def test_alora_on_qwen3_moe_attention_matches_peft(checkpoints, moe_adapters, tokenizer):
    from tests.conftest import INVOCATION

    base, adapter = checkpoints["qwen3_moe"], moe_adapters["qwen3_moe_alora"]
    llm = LLM(base, max_model_len=256, enable_lora=True, enable_activated_lora=True, max_loras=1, max_lora_rank=8)
    peft = load_peft_model(base, adapter)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3 + INVOCATION)
    check_against_reference(generate_one(llm, ids, LoRARequest("qa", 1, adapter)), hf_greedy(peft, ids, 10))


def test_adapter_on_expert_weights_is_refused(checkpoints, moe_adapters, tmp_path, tokenizer):
    """An adapter on expert projections (transformers 4 style, `experts.N.w1` modules) is
    refused naming the module; PEFT's `target_parameters` form is refused naming the option."""
    from peft import LoraConfig, get_peft_model

    base = checkpoints["mixtral"]
    legacy = str(tmp_path / "legacy")
    shutil.copytree(moe_adapters["mixtral_attn"], legacy)
    config_path = os.path.join(legacy, "adapter_config.json")
    with open(config_path) as f:
        adapter_config = json.load(f)
    adapter_config["target_modules"] = ATTENTION + ["w1"]
    with open(config_path, "w") as f:
        json.dump(adapter_config, f)
    weights = load_file(os.path.join(legacy, "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    weights[f"{prefix}.lora_A.weight"] = torch.randn(8, 64)
    weights[f"{prefix}.lora_B.weight"] = torch.randn(128, 8)
    save_file(weights, os.path.join(legacy, "adapter_model.safetensors"))

    fused = str(tmp_path / "fused")
    peft_config = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"],
                             init_lora_weights=False)
    get_peft_model(load_hf_model(base), peft_config).save_pretrained(fused)

    llm = LLM(base, max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"targets 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1'"):
        generate_one(llm, tokenizer.encode("hi"), LoRARequest("legacy", 1, legacy))
    with pytest.raises(ValueError, match="target_parameters"):
        generate_one(llm, tokenizer.encode("hi"), LoRARequest("fused", 2, fused))
