"""`AsyncLLM` in process: deltas that rebuild the offline output, validation errors that
come back to the caller, an abandoned stream that aborts its request, a failing step that
fails only the requests in flight, an engine left unusable that reports itself dead, no
busy spinning when idle, and a shutdown that joins the engine thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import INVOCATION
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from vllm.engine.llm_engine import LLMEngine
from vllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine(llama_dir):
    return LLMEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=128, enable_lora=True,
                                                 max_lora_rank=8), usage="server")


@pytest.fixture
def async_llm(engine):
    llm = AsyncLLM(engine)
    yield llm
    llm.shutdown()


def offline_text(engine: LLMEngine, prompt: str, params: SamplingParams) -> str:
    engine.add_request("offline", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    return final.outputs[0].text


def test_deltas_rebuild_the_whole_output(llama_dir, engine):
    expected = offline_text(engine, "hello world", GREEDY)
    llm = AsyncLLM(engine)

    async def run():
        deltas = [o async for o in llm.generate("hello world", GREEDY, "a")]
        whole = await (await llm.add_request("b", "hello world", GREEDY)).collect()
        return deltas, whole

    try:
        deltas, whole = asyncio.run(run())
    finally:
        llm.shutdown()
    assert len(deltas) == 8 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == expected == whole.outputs[0].text
    assert len(whole.outputs[0].token_ids) == 8 and "".join(whole.outputs[0].token_texts) == expected


def test_validation_error_reaches_the_caller(async_llm, adapters):
    alora = LoRARequest("alora_certainty", 1, adapters["alora_certainty"])

    async def run():
        with pytest.raises(ValueError, match="alora_certainty"):
            await async_llm.add_request("bad", "no invocation here", GREEDY, alora)
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            await async_llm.add_request("long", {"prompt_token_ids": [5] * 200}, GREEDY)
        ok = await (await async_llm.add_request("good", "hello" + INVOCATION, GREEDY, alora)).collect()
        return ok

    assert len(asyncio.run(run()).outputs[0].token_ids) == 8


def test_abandoned_stream_aborts_its_request(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def run():
        async for _ in async_llm.generate("hello", params, "leaver"):
            break  # the generator is closed here, which must abort the request
        for _ in range(100):
            stats = async_llm.get_stats()
            if stats.num_running == 0 and stats.kv_cache_usage == 0:
                return stats
            await asyncio.sleep(0.02)
        return async_llm.get_stats()

    stats = asyncio.run(run())
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    assert not async_llm.engine.has_unfinished_requests()


def test_failed_step_fails_in_flight_requests_only(async_llm):
    engine = async_llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = flaky_step
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def run():
        streams = [await async_llm.add_request(f"r{i}", "hello", params) for i in range(2)]
        for stream in streams:
            with pytest.raises(EngineStepError, match="injected step failure"):
                await stream.collect()
        async_llm.check_health()
        return await (await async_llm.add_request("after", "hello", GREEDY)).collect()

    after = asyncio.run(run())
    assert len(after.outputs[0].token_ids) == 8
    assert not engine.has_unfinished_requests() and async_llm.get_stats().kv_cache_usage == 0


def test_unusable_engine_reports_dead(async_llm):
    engine = async_llm.engine

    def broken(*args, **kwargs):
        raise RuntimeError("broken beyond repair")

    engine.step = broken
    engine.abort_request = broken

    async def run():
        stream = await async_llm.add_request("doomed", "hello", GREEDY)
        with pytest.raises(EngineStepError):
            await stream.collect()
        for _ in range(100):
            if async_llm.is_dead:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            async_llm.check_health()
        with pytest.raises(EngineDeadError):
            await async_llm.add_request("later", "hello", GREEDY)

    asyncio.run(run())


def test_idle_engine_thread_sleeps(async_llm):
    asyncio.run(asyncio.sleep(0.05))  # let start-up settle
    start = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - start < 0.05


def test_shutdown_joins_the_engine_thread(engine):
    llm = AsyncLLM(engine)
    llm.shutdown(timeout=10)
    assert not llm._thread.is_alive() and llm.is_dead

    async def run():
        with pytest.raises(EngineDeadError):
            await llm.add_request("x", "hello", GREEDY)

    asyncio.run(run())


def test_abort_from_elsewhere_ends_the_stream(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def run():
        stream = await async_llm.add_request("target", "hello", params)
        first = await stream.__anext__()
        await async_llm.abort("target")
        rest = [o async for o in stream]
        return first, rest

    first, rest = asyncio.run(run())
    assert not first.finished and all(not o.finished for o in rest)
    assert not async_llm.engine.has_unfinished_requests()
