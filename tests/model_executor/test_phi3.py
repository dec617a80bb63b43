"""Phi-3 family (`Phi3ForCausalLM`) against transformers and PEFT: fused `qkv_proj` /
`gate_up_proj` checkpoint tensors, longrope with the original context at the top of the
config, Phi-4-mini's partial rotary and tied embeddings; PEFT LoRA and aLoRA targeting the
fused modules; and refusals of what the engine does not serve."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig, Phi3Config

from tests.conftest import INVOCATION
from tests.lora.conftest import check_against_reference, generate_one
from tests.model_executor.configs import model_config_for
from tests.model_executor.paged import PagedRunner
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.checkpoints import TINY_SHAPE, load_hf_model
from tests.utils.reference import hf_greedy, hf_incremental_logits
from tests.utils.tokenizer import save_tokenizer
from vllm import LLM
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader import get_model

ORIGINAL = 32  # original_max_position_embeddings; max_position_embeddings is 128
MAX_NEW = 8


def _factors(n: int, scale: float) -> list[float]:
    return [1.0 + scale * i for i in range(n)]


VARIANTS = {
    # Phi-3.5-mini shape: full rotary (8 frequencies of a 16 head), untied head.
    "phi3": dict(tie_word_embeddings=False, rope_scaling={"type": "longrope", "short_factor": _factors(8, 0.2),
                                                          "long_factor": _factors(8, 3.0)}),
    # Phi-4-mini shape: 3/4 of each head rotated (6 frequencies), tied embeddings.
    "phi4_mini": dict(tie_word_embeddings=True, partial_rotary_factor=0.75,
                      rope_scaling={"type": "longrope", "short_factor": _factors(6, 0.3),
                                    "long_factor": _factors(6, 2.0)}),
    # Phi-3-mini-4k shape: a sliding window for every layer (2047 of 4096 there).
    "phi3_window": dict(tie_word_embeddings=False, sliding_window=11,
                        rope_scaling={"type": "longrope", "short_factor": _factors(8, 0.2),
                                      "long_factor": _factors(8, 3.0)}),
}


def make_phi3(path: str, variant: str) -> str:
    os.makedirs(path, exist_ok=True)
    tok = save_tokenizer(path)
    eos = tok.eos_token_id
    config = Phi3Config(**{**TINY_SHAPE, "max_position_embeddings": 128}, original_max_position_embeddings=ORIGINAL,
                        vocab_size=len(tok), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                        **{"sliding_window": None, **VARIANTS[variant]})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    GenerationConfig(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    return {v: make_phi3(str(root / v), v) for v in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_across_the_original_context(variant, phi3_dirs):
    """Chunked prefill, then decodes, against the transformers model fed the prompt (up to
    the original context) in one pass and then one token at a time over its KV cache.
    Longrope switches to long factors at the original context, per position, exactly as
    that incremental transformers run does; transformers' `generate` instead recomputes
    the whole sequence with long factors at the crossing (the documented difference, see
    vllm/model_executor/layers/rotary.py), so prompts of 7, 29 and 32 tokens match its
    generate only until the sequence passes 32."""
    path = phi3_dirs[variant]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.qkv_proj.weight" in f.keys()  # fused in the checkpoint itself
        assert "model.layers.0.mlp.gate_up_proj.weight" in f.keys()
    hf = load_hf_model(path)
    model_config = model_config_for(path, max_model_len=128)
    model = get_model(model_config, torch.device("cpu"))
    assert model.tie_word_embeddings == (variant == "phi4_mini")
    gen = torch.Generator().manual_seed(5)
    for prompt_len in (7, 29, ORIGINAL, 45):
        ids = torch.randint(0, model_config.vocab_size, (prompt_len + MAX_NEW,), generator=gen)
        hf_prefill = min(prompt_len, ORIGINAL)
        ref = hf_incremental_logits(hf, ids, hf_prefill)
        runner = PagedRunner(model, model_config.num_layers, model_config.num_kv_heads, model_config.head_size)
        split = prompt_len // 2 + 1
        logits = [runner.step([("s", ids[:split])])["s"], runner.step([("s", ids[split:prompt_len])])["s"]]
        logits += [runner.step([("s", ids[p : p + 1])])["s"] for p in range(prompt_len, len(ids))]
        torch.testing.assert_close(torch.cat(logits), ref, atol=1e-4, rtol=0)


def test_peft_lora_and_alora_on_fused_modules_match_peft(phi3_dirs, tmp_path, tokenizer):
    base = phi3_dirs["phi4_mini"]
    fused = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapters = {
        "lora": make_adapter(base, str(tmp_path / "lora"), fused, r=4, lora_alpha=8, seed=41),
        "alora": make_adapter(base, str(tmp_path / "alora"), fused, r=8, seed=42,
                              invocation_tokens=tokenizer.encode(INVOCATION)),
    }
    llm = LLM(base, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    conv = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    cases = {"lora": [conv], "alora": [conv + tokenizer.encode(INVOCATION)]}
    for i, (name, prompts) in enumerate(cases.items()):
        peft = load_peft_model(base, adapters[name])
        for ids in prompts:
            out = generate_one(llm, ids, LoRARequest(name, i + 1, adapters[name]))
            check_against_reference(out, hf_greedy(peft, ids, 10))
    # Base requests are Phi-3 itself, as transformers generates it.
    ids = tokenizer.encode("What is the capital of France?")
    check_against_reference(generate_one(llm, ids), hf_greedy(load_hf_model(base), ids, 10))


@pytest.mark.parametrize("base, change, message", [
    # Phi-3-small's own config.json: remote code, a model type transformers does not know.
    ("phi3", {"architectures": ["Phi3SmallForCausalLM"], "model_type": "phi3small"},
     "Phi3SmallForCausalLM is not supported. Supported: .*Phi3For"),
    ("phi3", {"architectures": ["NoSuchForCausalLM"]}, "NoSuchForCausalLM is not supported. Supported: "),
    # Phi3Config itself only accepts longrope; a Llama config passes any type on to us.
    ("llama", {"rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}},
     "RoPE type 'ntk-by-parts' is not supported. Supported: default, linear, dynamic, yarn, longrope, llama3"),
])
def test_unsupported_architecture_or_option_is_refused_at_load(phi3_dirs, checkpoints, tmp_path, base, change,
                                                               message):
    path = str(tmp_path / "bad")
    shutil.copytree(phi3_dirs[base] if base in phi3_dirs else checkpoints[base], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if "rope_scaling" in change:
        config.pop("rope_parameters", None)  # transformers 5 wrote it; it would win over rope_scaling
    config.update(change)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=64)
