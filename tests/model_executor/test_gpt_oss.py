"""gpt-oss beyond the shared parity suites (tests/model_executor/test_models.py and
tests/engine/test_parity.py run the tiny `gpt_oss` checkpoint against transformers):
the checkpoint really exercises sinks and biases, the interleaved expert layout is
de-interleaved at load, quantized (MXFP4) checkpoints are refused, and LoRA / aLoRA
on attention match PEFT."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.lora.conftest import check_against_reference, generate_one
from tests.model_executor.configs import model_config_for
from tests.model_executor.paged import PagedRunner
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.checkpoints import hf_config, load_hf_model
from tests.utils.reference import hf_greedy
from vllm import LLM
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader import get_model

CPU = torch.device("cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def base(checkpoints) -> str:
    return checkpoints["gpt_oss"]


def _logits(path: str, model=None) -> torch.Tensor:
    config = model_config_for(path)
    model = model or get_model(config, CPU)
    ids = torch.arange(3, 40)
    return PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_size).step([("a", ids)])["a"]


def test_checkpoint_exercises_sinks_biases_and_both_attention_kinds(base):
    """The parity suites only mean something if the features are live in the checkpoint."""
    weights = load_file(os.path.join(base, "model.safetensors"))
    for suffix in ("self_attn.sinks", "self_attn.q_proj.bias", "self_attn.o_proj.bias", "mlp.router.bias",
                   "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
        tensor = weights[f"model.layers.0.{suffix}"]
        assert tensor.abs().min() > 0, f"{suffix} has zeros: the feature would be half-tested"
    config = hf_config(base)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.sliding_window < 37  # shorter than the parity prompts
    assert config.rope_parameters["rope_type"] == "yarn"


def test_interleaved_experts_are_deinterleaved_at_load(base):
    """Checkpoint column 2j of `gate_up_proj[e]` is gate row j of w13[e], column 2j + 1 its
    up row j (rows I + j); `down_proj` and the biases follow the same mapping."""
    weights = load_file(os.path.join(base, "model.safetensors"))
    model = get_model(model_config_for(base), CPU)
    experts = model.model.layers[1].mlp.experts
    gate_up = weights["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I]
    bias = weights["model.layers.1.mlp.experts.gate_up_proj_bias"]  # [E, 2I]
    inter = gate_up.shape[2] // 2
    for e, j in [(0, 0), (1, 5), (3, inter - 1)]:
        assert torch.equal(experts.w13.weight[e, j], gate_up[e, :, 2 * j])
        assert torch.equal(experts.w13.weight[e, inter + j], gate_up[e, :, 2 * j + 1])
        assert experts.w13.bias[e, j] == bias[e, 2 * j] and experts.w13.bias[e, inter + j] == bias[e, 2 * j + 1]
    assert torch.equal(experts.w2.weight, weights["model.layers.1.mlp.experts.down_proj"].transpose(1, 2))
    assert torch.equal(experts.w2.bias, weights["model.layers.1.mlp.experts.down_proj_bias"])
    gate = model.model.layers[1].mlp.gate
    assert torch.equal(gate.bias, weights["model.layers.1.mlp.router.bias"])


def test_in_memory_state_dict_loads_like_the_file(base):
    """transformers' own parameters (the same names and layout) stream into the same model."""
    hf = load_hf_model(base)
    model = get_model(model_config_for(base, load_format="dummy"), CPU)
    model.load_weights(hf.state_dict().items())
    torch.testing.assert_close(_logits(base, model), _logits(base), atol=0, rtol=0)


def _with_config(src: str, dst: str, **fields) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_mxfp4_checkpoint_is_refused(base, tmp_path):
    """openai/gpt-oss-20b's config declares MXFP4 experts: refused with the method named
    and what is supported, before any weight is read."""
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    path = _with_config(base, str(tmp_path / "mxfp4"), quantization_config=mxfp4)
    expected = r"quant_method='mxfp4'.*Supported: unquantized bf16, fp16 or fp32 checkpoints \(e\.g\. gpt-oss"
    with pytest.raises(ValueError, match=expected):
        get_model(model_config_for(path), CPU)
    with pytest.raises(ValueError, match=expected):
        LLM(path, max_model_len=128)


@pytest.fixture(scope="module")
def gpt_oss_adapters(base, tmp_path_factory, tokenizer):
    from tests.conftest import INVOCATION

    root = tmp_path_factory.mktemp("gpt_oss_adapters")
    inv = tokenizer.encode(INVOCATION, add_special_tokens=False)
    return {
        "lora": make_adapter(base, str(root / "lora"), ATTENTION, r=8, seed=41),
        "alora": make_adapter(base, str(root / "alora"), ATTENTION, r=8, seed=42, invocation_tokens=inv),
    }


def test_lora_on_attention_matches_peft(base, gpt_oss_adapters, tokenizer):
    adapter = gpt_oss_adapters["lora"]
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_batched_tokens=24)
    peft = load_peft_model(base, adapter)
    request = LoRARequest("gpt_oss_attn", 1, adapter)
    # The second prompt runs past the sliding window, in chunks.
    for text in ["What is the capital of France?", "one two three four five six seven eight " * 3]:
        ids = tokenizer.encode(text)
        check_against_reference(generate_one(llm, ids, request), hf_greedy(peft, ids, 10))


def test_alora_on_attention_matches_peft(base, gpt_oss_adapters, tokenizer):
    from tests.conftest import INVOCATION

    adapter = gpt_oss_adapters["alora"]
    llm = LLM(base, max_model_len=256, enable_lora=True, enable_activated_lora=True, max_loras=1, max_lora_rank=8)
    peft = load_peft_model(base, adapter)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3 + INVOCATION)
    check_against_reference(generate_one(llm, ids, LoRARequest("gpt_oss_alora", 1, adapter)), hf_greedy(peft, ids, 10))


def test_config_without_swiglu_fields_takes_the_released_values(base):
    """transformers 5.17's GptOssConfig has no `swiglu_alpha`/`swiglu_limit` (its model hard-codes
    1.702 and 7.0): such a config loads with those values; a config that has them is honoured."""
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    config = hf_config(base)
    assert GptOssForCausalLM.moe_options(config).activation.limit == config.swiglu_limit == 3.0
    for field in ("swiglu_alpha", "swiglu_limit"):
        if hasattr(config, field):
            delattr(config, field)
    activation = GptOssForCausalLM.moe_options(config).activation
    assert (activation.kind, activation.alpha, activation.limit) == ("swiglu_clamped", 1.702, 7.0)
