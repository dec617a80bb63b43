"""`priority=` through `LLM.generate`, `LLMEngine.add_request` and `AsyncLLM.add_request`
with scheduling_policy="priority" (lower runs earlier), and its refusal under FCFS."""

from __future__ import annotations

import asyncio

import pytest

from vllm import LLM, EngineArgs, SamplingParams
from vllm.engine.async_llm import AsyncLLM

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = ["one two three", "The quick brown fox", "What is the capital"]


@pytest.fixture(scope="module")
def one_at_a_time(llama_dir):
    return LLM(llama_dir, max_model_len=128, max_num_seqs=1, scheduling_policy="priority")


def finish_order(llm, add_late=None):
    """Ids in the order they finish; `add_late` runs once, after the first step."""
    engine, order = llm.llm_engine, []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
        if add_late is not None:
            add_late()
            add_late = None
    return order


def test_high_priority_submitted_later_finishes_first(one_at_a_time):
    engine = one_at_a_time.llm_engine
    engine.add_request("low-1", PROMPTS[0], PARAMS, priority=5)
    engine.add_request("low-2", PROMPTS[1], PARAMS, priority=5)
    # After the first step low-1 runs (no preemption for priority alone); high overtakes low-2.
    order = finish_order(one_at_a_time, lambda: engine.add_request("high", PROMPTS[2], PARAMS, priority=-1))
    assert order == ["low-1", "high", "low-2"]


def test_generate_priority_list(one_at_a_time):
    outputs = one_at_a_time.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[1, 1, 0])
    finished = [o.metrics.finished_time for o in outputs]
    assert finished[2] < finished[0] < finished[1]
    same = one_at_a_time.generate(PROMPTS, PARAMS, use_tqdm=False, priority=0)
    assert [o.outputs[0].token_ids for o in same] == [o.outputs[0].token_ids for o in outputs]


def test_priority_refused_under_fcfs_and_checked(llm, one_at_a_time):
    with pytest.raises(ValueError, match="priority scheduling is not enabled.*scheduling_policy='priority'"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 1, 0])
    assert llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, priority=0)[0].finished
    with pytest.raises(ValueError, match="priority has 2 entries but there are 3 prompts"):
        one_at_a_time.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        one_at_a_time.generate(PROMPTS[:1], PARAMS, use_tqdm=False, priority=0.5)
    assert not one_at_a_time.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy must be one of 'fcfs', 'priority'"):
        EngineArgs(model="unused", scheduling_policy="lifo")._scheduling_policy()


def test_async_llm_priority(llama_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=llama_dir, max_model_len=128, scheduling_policy="priority"))

    async def run():
        stream = await llm.add_request("a", PROMPTS[0], PARAMS, priority=-3)
        return await stream.collect()

    try:
        assert len(asyncio.run(run()).outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
