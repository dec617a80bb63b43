"""aLoRA KV reuse seen by an HTTP client: a base chat turn, then the aLoRA intrinsic on the
same conversation (final turn carrying the invocation) reports cached prompt tokens in
`usage.prompt_tokens_details.cached_tokens`, and answers exactly what the offline engine
answers for the same conversation."""

from __future__ import annotations

import pytest

from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

CONVERSATION = [
    {"role": "system",
     "content": "Knowledge Cutoff Date: April 2024. You are a helpful assistant developed for tests."},
    {"role": "user", "content": "Please answer the question using the documents provided. What is the capital of "
                                "France? How certain are you about that answer?"},
]


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, max_model_len=MAX_MODEL_LEN, enable_lora=True, max_lora_rank=8, max_loras=2)


@pytest.mark.parametrize("adapter, role, lora_id", [("alora_certainty", "certainty", 1),
                                                    ("alora_answerability", "answerability", 2)])
def test_alora_turn_reuses_base_kv_and_matches_offline(server, client, offline, adapters, adapter, role, lora_id):
    before = server.metrics()["vllm:alora_reused_prompt_tokens_total"]
    base = client.chat.completions.create(model=MODEL, messages=CONVERSATION, temperature=0.0, max_tokens=8)
    answer = base.choices[0].message.content
    intrinsic = CONVERSATION + [{"role": "assistant", "content": answer}, {"role": role, "content": ""}]
    result = client.chat.completions.create(model=adapter, messages=intrinsic, temperature=0.0, max_tokens=6,
                                            extra_body={"ignore_eos": True})
    cached = result.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32, "the base turn's system and user blocks should be reused"
    assert cached < result.usage.prompt_tokens
    assert server.metrics()["vllm:alora_reused_prompt_tokens_total"] - before >= cached

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = offline.chat(intrinsic, params, use_tqdm=False,
                            lora_request=LoRARequest(adapter, lora_id, adapters[adapter]))[0]
    assert len(expected.prompt_token_ids) == result.usage.prompt_tokens
    assert result.choices[0].message.content == expected.outputs[0].text


def test_cache_salt_isolates_prefix_cache(client):
    messages = CONVERSATION + [{"role": "user", "content": "one two three four five six seven eight nine ten"}]

    def cached(salt):
        extra = {"cache_salt": salt} if salt else {}
        result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=extra)
        return result.usage.prompt_tokens_details.cached_tokens

    cached(None)
    assert cached(None) > 0
    assert cached("tenant-a") == 0 and cached("tenant-a") > 0 and cached("tenant-b") == 0
