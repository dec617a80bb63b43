"""OLMoE and Granite 4 with experts beyond the shared parity suites (which run both
through tests/model_executor/test_models.py and tests/engine/test_parity.py): adapters
against PEFT, the class the Granite 4 architecture name builds, checkpoint layouts, and
refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.lora.conftest import check_against_reference, generate_one
from tests.model_executor.configs import model_config_for
from tests.model_executor.paged import PagedRunner
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.checkpoints import hf_config, load_hf_model
from tests.utils.reference import hf_greedy
from vllm import LLM
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM, GraniteMoeHybridMoeForCausalLM

CPU = torch.device("cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _logits(path: str, model=None) -> torch.Tensor:  # [37, vocab] for one prompt
    config = model_config_for(path)
    model = model or get_model(config, CPU)
    ids = torch.arange(3, 40)
    return PagedRunner(model, config.num_layers, config.num_kv_heads, config.head_size).step([("a", ids)])["a"]


def _with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_granite4_architecture_builds_the_moe_variant_only_with_experts(checkpoints):
    dense = GraniteMoeHybridForCausalLM(hf_config(checkpoints["granite4"]), torch.float32, CPU)
    assert type(dense) is GraniteMoeHybridForCausalLM
    assert not any(isinstance(m, FusedMoE) for m in dense.modules())
    moe = GraniteMoeHybridForCausalLM(hf_config(checkpoints["granite4_moe"]), torch.float32, CPU)
    assert type(moe) is GraniteMoeHybridMoeForCausalLM
    layer = moe.model.layers[0].mlp
    assert isinstance(layer, FusedMoE) and layer.shared_mlp is not None
    assert layer.experts.w13.weight.shape == (4, 2 * 128, 64)  # intermediate_size 128 per expert
    assert layer.shared_mlp.down_proj.input_size == 96  # shared_intermediate_size


def test_olmoe_fused_expert_layout_loads_like_per_expert(checkpoints):
    """transformers 5's in-memory layout (`mlp.experts.gate_up_proj`) loads into the same
    model as the per-expert tensors `save_pretrained` writes."""
    path = checkpoints["olmoe"]
    hf = load_hf_model(path)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in hf.state_dict())
    model = get_model(model_config_for(path, load_format="dummy"), CPU)
    model.load_weights(hf.state_dict().items())
    torch.testing.assert_close(_logits(path, model), _logits(path), atol=0, rtol=0)


@pytest.mark.parametrize("layer_types", [["mamba", "attention"], ["attention", "linear_attention"]])
def test_granite4_moe_with_mamba_layers_is_refused(checkpoints, tmp_path, layer_types):
    path = _with_config(checkpoints["granite4_moe"], tmp_path / "g4", layer_types=layer_types)
    with pytest.raises(ValueError, match=r"Mamba layers \(layer_types '(mamba|linear_attention)' at layers \d\)"
                                         r".*does not support.*with experts next to it"):
        LLM(path, max_model_len=64)


def test_olmoe_bad_clip_qkv_is_refused(checkpoints, tmp_path):
    path = _with_config(checkpoints["olmoe"], tmp_path / "o", clip_qkv=-1.0)
    with pytest.raises(ValueError, match=r"clip_qkv must be a positive number or null, got -1\.0"):
        get_model(model_config_for(path), CPU)


@pytest.fixture(scope="module")
def family_adapters(checkpoints, tmp_path_factory, tokenizer):
    from tests.conftest import INVOCATION

    root = tmp_path_factory.mktemp("moe_family_adapters")
    inv = tokenizer.encode(INVOCATION, add_special_tokens=False)
    return {
        # Attention only: PEFT would turn MLP projection names into expert-parameter targets.
        "olmoe": make_adapter(checkpoints["olmoe"], str(root / "olmoe"), ATTENTION, r=8, seed=41),
        # Attention and the shared MLP next to the experts (PEFT's names, aliased to ours).
        "granite4_moe": make_adapter(
            checkpoints["granite4_moe"], str(root / "granite4_moe"),
            r".*\.(q_proj|v_proj|o_proj|shared_mlp\.input_linear|shared_mlp\.output_linear)", r=8, seed=42,
            invocation_tokens=inv),
    }


def test_lora_on_attention_of_olmoe_matches_peft(checkpoints, family_adapters, tokenizer):
    base, adapter = checkpoints["olmoe"], family_adapters["olmoe"]
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_batched_tokens=24)
    peft = load_peft_model(base, adapter)
    request = LoRARequest("olmoe_attn", 1, adapter)
    for text in ["What is the capital of France?", "one two three four five six seven eight " * 3]:
        ids = tokenizer.encode(text)
        check_against_reference(generate_one(llm, ids, request), hf_greedy(peft, ids, 10))


def test_alora_on_granite4_moe_attention_and_shared_mlp_matches_peft(checkpoints, family_adapters, tokenizer):
    from tests.conftest import INVOCATION

    base, adapter = checkpoints["granite4_moe"], family_adapters["granite4_moe"]
    llm = LLM(base, max_model_len=256, enable_lora=True, enable_activated_lora=True, max_loras=1, max_lora_rank=8)
    peft = load_peft_model(base, adapter)
    request = LoRARequest("g4_alora", 1, adapter)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3 + INVOCATION)
    out = generate_one(llm, ids, request)
    check_against_reference(out, hf_greedy(peft, ids, 10))
    # The adapter does something: the base model's greedy continuation differs.
    assert out.outputs[0].token_ids != generate_one(llm, ids).outputs[0].token_ids
    # Its shared-MLP weights reached our fused module (both slices of gate_up).
    loaded = llm.llm_engine.engine_core.lora_adapters.get(request)
    layer = loaded.layers["model.layers.0.mlp.shared_mlp.gate_up_proj"]
    assert all(a is not None and a.abs().sum() > 0 for a in layer.lora_a)
