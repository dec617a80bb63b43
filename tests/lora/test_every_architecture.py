"""A PEFT LoRA and a PEFT aLoRA on the attention of every supported test architecture match
PEFT: greedy tokens identical, logprobs within 1e-4 (fp32). The families' own files test more
targets (dense MLPs, shared experts, fused checkpoint modules); this is the floor every
architecture meets, sliding-window and MoE ones included."""

from __future__ import annotations

import pytest

from tests.conftest import INVOCATION
from tests.lora.conftest import GREEDY, check_against_reference, generate_one
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.checkpoints import ARCHITECTURES
from tests.utils.reference import hf_greedy
from vllm import LLM
from vllm.lora.request import LoRARequest

# Phi-3 checkpoints (and PEFT adapters for them) name the fused module.
ATTENTION = {"phi3": ["qkv_proj", "o_proj"]}
PROMPT = "The quick brown fox jumps over the lazy dog. Please answer the question. " * 2


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_and_alora_on_attention_match_peft(arch, checkpoints, tokenizer, tmp_path):
    base = checkpoints[arch]
    targets = ATTENTION.get(arch, ["q_proj", "v_proj", "o_proj"])
    invocation = tokenizer.encode(INVOCATION, add_special_tokens=False)
    lora = make_adapter(base, str(tmp_path / "lora"), targets, r=8, seed=51)
    alora = make_adapter(base, str(tmp_path / "alora"), targets, r=8, seed=52, invocation_tokens=invocation)
    llm = LLM(base, max_model_len=256, enable_lora=True, enable_activated_lora=True, max_loras=2, max_lora_rank=8)
    ids = tokenizer.encode(PROMPT)
    alora_ids = ids + tokenizer.encode(INVOCATION)
    new_tokens = GREEDY.max_tokens
    check_against_reference(generate_one(llm, ids, LoRARequest("lora", 1, lora)),
                            hf_greedy(load_peft_model(base, lora), ids, new_tokens))
    check_against_reference(generate_one(llm, alora_ids, LoRARequest("alora", 2, alora)),
                            hf_greedy(load_peft_model(base, alora), alora_ids, new_tokens))
