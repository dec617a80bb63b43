"""Capacity with the tiny llama: a request that can never fit is refused at admission (offline
ValueError, OpenAI-shaped 400 over HTTP) and the engine keeps serving; under heavy preemption
in a tiny KV cache every request finishes with exactly the tokens of an unconstrained engine
(greedy; LoRA, aLoRA, n > 1 and shared prefixes included); with max_num_seqs saturated,
requests are admitted in arrival order."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import INVOCATION
from tests.entrypoints.utils import RemoteOpenAIServer
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.engine.llm_engine import LLMEngine
from vllm.lora.request import LoRARequest

MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
MODEL = "tiny-llama"


def test_engine_refuses_a_cache_smaller_than_one_request(llama_dir):
    with pytest.raises(ValueError, match="fewer than max_model_len=64"):
        LLM(llama_dir, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_gpu_blocks_override=15)


def test_prompt_larger_than_the_cache_is_refused_offline(llama_dir, tokenizer):
    # 16 blocks of 4 = 64 tokens: exactly one max_model_len request.
    llm = LLM(llama_dir, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match=r"prompt \(length 80\) is longer than the maximum model length of 64"):
        llm.generate({"prompt_token_ids": [5] * 80}, SamplingParams(max_tokens=4), use_tqdm=False)
    # The largest request that fits runs to max_model_len in a cache it fills completely.
    out = llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert not llm.llm_engine.has_unfinished_requests()


def _workload(tokenizer, adapters):
    """(prompt, params, lora) triples: base, LoRA and aLoRA requests, shared prefixes, n=2."""
    shared = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    alora = LoRARequest("certainty", 2, adapters["alora_certainty"])
    lora = LoRARequest("all", 1, adapters["lora_all"])
    work = []
    for i in range(5):
        prompt = shared + tokenizer.encode(f" story {i}")
        lora_request = (None, lora, alora)[i % 3]
        if lora_request is alora:
            prompt = prompt + tokenizer.encode(INVOCATION, add_special_tokens=False)
        params = SamplingParams(temperature=0.0, max_tokens=8 + 2 * (i % 2), ignore_eos=True, n=2 if i == 4 else 1)
        work.append(({"prompt_token_ids": prompt}, params, lora_request))
    return work


def _run(llm: LLM, work) -> list[list[list[int]]]:
    prompts, params, loras = zip(*work)
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False, lora_request=list(loras))
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_heavy_preemption_keeps_greedy_outputs(llama_dir, tokenizer, adapters):
    common = dict(max_model_len=32, block_size=BLOCK_SIZE, enable_lora=True, max_loras=2, max_lora_rank=8,
                  enable_prefix_caching=True)
    work = _workload(tokenizer, adapters)
    expected = _run(LLM(llama_dir, **common, num_gpu_blocks_override=256), work)
    # 8 blocks = 32 tokens, one whole request; six sequences of 24 to 32 tokens each want 40 blocks.
    tight = LLM(llama_dir, **common, num_gpu_blocks_override=8)
    assert _run(tight, work) == expected
    stats = tight.llm_engine.engine_core.get_stats()
    assert stats.num_preemptions >= 3, stats
    assert stats.num_free_blocks == 8 and stats.num_running == stats.num_waiting == 0


def test_max_num_seqs_queues_in_arrival_order(llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=2),
                                        usage="server")
    llm = AsyncLLM(engine)

    async def run():
        streams = []
        for i in range(8):  # added one after another: arrival order is i
            params = SamplingParams(temperature=0.0, max_tokens=2 + (7 * i) % 5, ignore_eos=True)
            streams.append(await llm.add_request(f"r{i}", f"request {i} says", params))
        return [await s.collect() for s in streams]

    try:
        outputs = asyncio.run(run())
    finally:
        llm.shutdown()
    first_tokens = [o.metrics.first_token_time for o in outputs]
    assert first_tokens == sorted(first_tokens), "a later request was admitted before an earlier one"
    assert len(set(first_tokens)) >= 4  # two at a time: at least four admission waves


@pytest.fixture(scope="module")
def small_server(llama_dir):
    args = ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", "16", "--max-num-seqs", "2"]
    with RemoteOpenAIServer(llama_dir, args) as server:
        yield server


def test_request_that_cannot_fit_is_a_400_and_the_server_keeps_serving(small_server):
    url = small_server.url + "/v1/completions"
    too_long = httpx.post(url, json={"model": MODEL, "prompt": [5] * 100, "max_tokens": 4})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and "maximum context length is 64" in \
        error["message"]
    no_room = httpx.post(url, json={"model": MODEL, "prompt": [5] * 40, "max_tokens": 30})
    assert no_room.status_code == 400 and "max_tokens" in no_room.json()["error"]["message"]

    async def burst():
        client = small_server.async_client()
        calls = [client.completions.create(model=MODEL, prompt=[7 + i] * 48, max_tokens=14,
                                           temperature=0.0, extra_body={"ignore_eos": True}) for i in range(3)]
        return await asyncio.gather(*calls)

    # Three requests of nearly the whole cache each: they preempt one another and all complete.
    for result in asyncio.run(burst()):
        assert result.usage.completion_tokens == 14
    assert httpx.get(small_server.url + "/health").status_code == 200
