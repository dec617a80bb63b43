"""Prefix caching on a Granite Switch checkpoint, and equivalence with PEFT adapters.

- After a base turn, a Switch aLoRA request reuses the full blocks before its control
  token; a Switch LoRA request (control token at position 0) reuses nothing; two Switch
  aLoRAs share the base blocks with each other.
- The same adapters served as PEFT adapters through `LoRARequest` (on the base
  checkpoint) and inside the Switch checkpoint give identical tokens when the prompts
  render the same (control token replaced by its substitute).
"""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? " * 6},
    {"role": "assistant", "content": "The capital of France is Paris. " * 6},
    {"role": "user", "content": "Is this request safe?\n<guardian> Please check the last message."},
]


def full_blocks_before(ids: list[int], control_id: int) -> int:
    return ids.index(control_id) // BLOCK * BLOCK


@pytest.fixture
def llm(switch_assets):
    return LLM(switch_assets.switch_dir, dtype="float32", max_model_len=512, block_size=BLOCK)


def chat(llm: LLM, adapter: str | None = None):
    kwargs = {"adapter_name": adapter} if adapter else None
    return llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)[0]


def test_switch_alora_reuses_the_base_turn_and_lora_reuses_nothing(llm, switch_assets):
    base = chat(llm)
    assert base.num_cached_tokens == 0
    for name in ("rewrite", "guardian"):
        out = chat(llm, name)
        control = switch_assets.adapter(name).control_token_id
        assert control in out.prompt_token_ids
        assert out.num_cached_tokens == full_blocks_before(out.prompt_token_ids, control) > 0
    citations = chat(llm, "citations")
    assert citations.prompt_token_ids[0] == switch_assets.adapter("citations").control_token_id
    assert citations.num_cached_tokens == 0


def test_two_switch_aloras_share_base_blocks_without_a_base_turn(llm, switch_assets):
    rewrite = chat(llm, "rewrite")  # computes the conversation (base blocks) and its own tail
    assert rewrite.num_cached_tokens == 0
    guardian = chat(llm, "guardian")
    control = switch_assets.adapter("guardian").control_token_id
    assert guardian.num_cached_tokens == full_blocks_before(guardian.prompt_token_ids, control) > 0
    # And a base request afterwards hits the blocks both computed before their controls.
    assert chat(llm).num_cached_tokens >= guardian.num_cached_tokens


@pytest.mark.parametrize("name", ["rewrite", "guardian", "citations"])
def test_switch_adapter_equals_the_same_peft_adapter(switch_assets, name):
    """Embedded in the checkpoint, or a PEFT LoRARequest on the base: same greedy tokens."""
    info = switch_assets.adapter(name)
    switch_ids = info.sample["prompt_token_ids"]
    base_ids = [info.substitute_token_id if t == info.control_token_id else t for t in switch_ids]
    assert base_ids == info.sample["base_prompt_token_ids"]  # the prompts render the same
    switch = LLM(switch_assets.switch_dir, dtype="float32", max_model_len=256)
    peft = LLM(switch_assets.base_dir, dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8)
    ours = switch.generate([{"prompt_token_ids": switch_ids}], GREEDY, use_tqdm=False)[0].outputs[0]
    theirs = peft.generate([{"prompt_token_ids": base_ids}], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest(name, 1, info.path))[0].outputs[0]
    plain = peft.generate([{"prompt_token_ids": base_ids}], GREEDY, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids
    assert theirs.token_ids != plain.token_ids  # the adapter changes the answer, so equality means something
