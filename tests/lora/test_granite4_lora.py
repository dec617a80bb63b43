"""Granite 4 (dense GraniteMoeHybrid): PEFT LoRA and aLoRA parity on its own module names
(`shared_mlp.input_linear` fused gate|up, `shared_mlp.output_linear`), and the refusal of
Granite 4 checkpoints with Mamba layers (Granite 4 with experts: tests/model_executor/test_moe_families.py)."""

import json
import os
import shutil

import pytest

from tests.conftest import INVOCATION
from tests.lora.conftest import MAX_NEW, check_against_reference, generate_one
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.reference import hf_greedy
from vllm import LLM
from vllm.lora.request import LoRARequest

GRANITE4_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "input_linear", "output_linear"]


@pytest.fixture(scope="module")
def granite4(checkpoints, tmp_path_factory, tokenizer):
    base = checkpoints["granite4"]
    root = tmp_path_factory.mktemp("granite4_adapters")
    adapters = {
        "lora_mlp": make_adapter(base, str(root / "lora_mlp"), ["q_proj", "input_linear", "output_linear"], r=4,
                                 lora_alpha=8, seed=31),
        "alora_all": make_adapter(base, str(root / "alora_all"), GRANITE4_ALL, r=8, seed=32,
                                  invocation_tokens=tokenizer.encode(INVOCATION)),
    }
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    return base, adapters, llm


def test_peft_lora_and_alora_match_on_granite4(granite4, tokenizer):
    base, adapters, llm = granite4
    conv = tokenizer.encode("The quick brown fox jumps over the lazy dog. What is the capital of France? " * 3)
    cases = {
        "lora_mlp": [tokenizer.encode("What is the capital of France?"), conv],
        "alora_all": [conv + tokenizer.encode(INVOCATION), conv[:9] + tokenizer.encode(INVOCATION) + conv[9:20]],
    }
    for i, (name, prompts) in enumerate(cases.items()):
        peft = load_peft_model(base, adapters[name])
        request = LoRARequest(name, i + 1, adapters[name])
        for ids in prompts:
            check_against_reference(generate_one(llm, ids, request), hf_greedy(peft, ids, MAX_NEW))


def test_granite4_fused_mlp_adapter_fills_both_slices(granite4):
    """The fused PEFT `input_linear` weights land in both our gate and up slices: the same
    A, and B's first rows (gate) and last rows (up)."""
    from safetensors.torch import load_file

    _, adapters, llm = granite4
    adapter = llm.llm_engine.engine_core.lora_adapters.get(LoRARequest("lora_mlp", 1, adapters["lora_mlp"]))
    layer = adapter.layers["model.layers.0.mlp.gate_up_proj"]
    peft = load_file(os.path.join(adapters["lora_mlp"], "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.shared_mlp.input_linear.lora_{}.weight"
    a, b = peft[key.format("A")], peft[key.format("B")] * (8 / 4)  # alpha / r
    for i, rows in enumerate((slice(0, 96), slice(96, 192))):
        assert (layer.lora_a[i] == a).all()
        assert (layer.lora_b[i] - b[rows]).abs().max() < 1e-6


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["mamba", "attention"]}, "Mamba layers"),
    ({"layer_types": ["attention", "linear_attention"]}, "Mamba layers"),
])
def test_granite4_with_mamba_is_refused(checkpoints, tmp_path, change, message):
    path = tmp_path / "g4"
    shutil.copytree(checkpoints["granite4"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        LLM(str(path), max_model_len=64)
    assert "granite-4.0-micro" in str(info.value)
    assert os.path.isdir(path)
