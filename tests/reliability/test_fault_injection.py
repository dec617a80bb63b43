"""Injected faults (VLLM_FAULT_INJECTION, vllm/fault_injection.py): a failing model step, a
fatal one, a partial adapter load, a tokenizer bug and a grammar-compiler bug each fail only
the requests they touch, with an error saying so, and the engine keeps serving correctly
(no leaked KV block, no poisoned prefix cache, no half-loaded adapter), in process and over
HTTP. A fatal step kills the async engine at once and nothing hangs."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.utils import RemoteOpenAIServer
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from vllm.engine.llm_engine import LLMEngine
from vllm.fault_injection import KINDS, InjectedFault, parse
from vllm.lora.lora_model import load_lora_model
from vllm.lora.request import LoRARequest

ENV = "VLLM_FAULT_INJECTION"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Three full 16-token blocks and more: a failed prefill registers blocks in the prefix cache.
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 8


# ------------------------------------------------------------------ the spec
def test_spec_parses_every_kind():
    plan = parse(" step=3, step=7 ,step_fatal=9,adapter_load=lora_qkv,tokenizer=BOOM,grammar=G=1,")
    assert plan.steps == {3, 7} and plan.fatal_steps == {9} and plan.adapters == {"lora_qkv"}
    assert plan.tokenizer_texts == ("BOOM",) and plan.grammar_texts == ("G=1",)
    assert parse(None) == parse("") == parse("  ")


@pytest.mark.parametrize("spec, entry", [
    ("stepp=3", "stepp=3"), ("step=0", "step=0"), ("step=x", "step=x"), ("step_fatal=-1", "step_fatal=-1"),
    ("tokenizer=", "tokenizer="), ("step=2,boom", "boom"),
])
def test_invalid_spec_names_the_entry_and_the_kinds(spec, entry):
    with pytest.raises(ValueError, match="VLLM_FAULT_INJECTION") as info:
        parse(spec)
    assert repr(entry) in str(info.value) and ", ".join(KINDS) in str(info.value)


def test_invalid_spec_fails_start_up(llama_dir, monkeypatch):
    monkeypatch.setenv(ENV, "step=3,tokenize=BOOM")
    with pytest.raises(ValueError, match="'tokenize=BOOM'"):
        LLM(llama_dir, max_model_len=128)


# ------------------------------------------------------------------ in process
def _engine(llama_dir, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=llama_dir, max_model_len=128, block_size=16, **kwargs),
                                      usage="server")


def _run(engine: LLMEngine, prompt: str, params: SamplingParams = GREEDY) -> list[int]:
    engine.add_request("offline", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
    return tokens


def _all_blocks_free(engine: LLMEngine) -> bool:
    stats = engine.get_stats()
    return stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0


def test_step_fault_fails_only_the_requests_it_scheduled(llama_dir, monkeypatch):
    # Two sequences per step: the doomed request's two samples fill it, the others wait.
    engine = _engine(llama_dir, max_num_seqs=2)
    runner = engine.engine_core.runner
    expected = {p: _run(engine, p) for p in (LONG_PROMPT, "hello world", "one two three")}
    assert engine.reset_prefix_cache()  # so the doomed prefill allocates (and registers) fresh blocks
    llm = AsyncLLM(engine)

    async def run():
        # 1. A prefill fails (the variable is read at every step).
        monkeypatch.setenv(ENV, f"step={runner.num_model_steps + 1}")
        with pytest.raises(EngineStepError, match="Injected fault at model step"):
            await (await llm.add_request("prefill", LONG_PROMPT, GREEDY)).collect()
        # 2. A decode step fails while two requests wait behind the running one.
        doomed = await llm.add_request("doomed", "hello", SamplingParams(n=2, temperature=1.0, seed=0,
                                                                         max_tokens=40, ignore_eos=True))
        await doomed.__anext__()
        waiting = [await llm.add_request(f"w{i}", p, GREEDY) for i, p in enumerate(["hello world", "one two three"])]
        monkeypatch.setenv(ENV, f"step={runner.num_model_steps + 2}")  # both are in the engine by now
        with pytest.raises(EngineStepError, match="Injected fault at model step"):
            await doomed.collect()
        outputs = await asyncio.gather(*(s.collect() for s in waiting))
        llm.check_health()
        again = await (await llm.add_request("again", LONG_PROMPT, GREEDY)).collect()
        return outputs, again

    try:
        outputs, again = asyncio.run(run())
        assert [o.outputs[0].token_ids for o in outputs] == [expected["hello world"], expected["one two three"]]
        # The failed prefill's blocks never held KV: a prefix hit on them would change this output.
        assert again.outputs[0].token_ids == expected[LONG_PROMPT]
        assert _all_blocks_free(engine) and not engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_step_fatal_kills_the_async_engine(llama_dir, monkeypatch):
    engine = _engine(llama_dir, max_num_seqs=1)
    monkeypatch.setenv(ENV, "step_fatal=2")
    llm = AsyncLLM(engine)

    async def run():
        # Hold the engine thread until both requests are queued: otherwise, on a loaded machine, it
        # can run steps 1 and 2 before the second request arrives, and that request is refused at
        # add_request instead of failing in the queue, which is what this test is about.
        gate = threading.Event()
        llm._commands.put((gate.wait, (), None, None))
        adds = [asyncio.ensure_future(llm.add_request("running", "hello", GREEDY)),
                asyncio.ensure_future(llm.add_request("waiting", "hello there", GREEDY))]
        await asyncio.sleep(0)  # both adds reach the command queue (the put comes before their first await)
        gate.set()
        running, waiting = await asyncio.gather(*adds)
        for stream in (running, waiting):
            with pytest.raises(EngineDeadError, match="Injected fatal fault at model step 2"):
                await asyncio.wait_for(stream.collect(), timeout=30)
        assert llm.is_dead
        with pytest.raises(EngineDeadError):
            llm.check_health()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(llm.add_request("later", "hello", GREEDY), timeout=30)

    try:
        asyncio.run(run())
    finally:
        llm.shutdown(timeout=10)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=128, block_size=16, enable_lora=True, max_lora_rank=8, max_loras=2)


def test_partial_adapter_load_leaves_nothing_behind(llm, adapters, monkeypatch):
    engine = llm.llm_engine
    manager = engine.engine_core.runner.lora_manager
    doomed = LoRARequest("lora_all", 41, adapters["lora_all"])
    monkeypatch.setenv(ENV, "adapter_load=lora_all")
    with pytest.raises(InjectedFault, match="'lora_all' after .* tensors"):
        llm.generate(["hello", "hello there"], GREEDY, lora_request=doomed, use_tqdm=False)
    assert 41 not in manager.adapters._cache and 41 not in manager._slots
    # Another adapter loads and runs meanwhile; the failed one loads whole once the fault is cleared.
    good = llm.generate("hello", GREEDY, lora_request=LoRARequest("lora_qkv", 42, adapters["lora_qkv"]),
                        use_tqdm=False)
    assert len(good[0].outputs[0].token_ids) == 6
    monkeypatch.delenv(ENV)
    llm.generate("hello", GREEDY, lora_request=doomed, use_tqdm=False)
    loaded, cache = manager.adapters.get(doomed), manager.adapters
    fresh = load_lora_model(41, "lora_all", adapters["lora_all"], loaded.peft, cache.specs,
                            cache.config.max_lora_rank, cache.dtype)
    assert loaded.layers.keys() == fresh.layers.keys()
    for name, layer in fresh.layers.items():
        for ours, theirs in zip(loaded.layers[name].lora_a + loaded.layers[name].lora_b, layer.lora_a + layer.lora_b):
            assert (ours is None and theirs is None) or bool((ours == theirs).all())
    assert _all_blocks_free(engine)


def test_tokenizer_fault_fails_only_its_request(llm, monkeypatch):
    expected = llm.generate("hello world", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setenv(ENV, "tokenizer=TOKBOOM")
    with pytest.raises(InjectedFault, match="tokenizing the prompt"):
        llm.generate(["hello world", "say TOKBOOM now"], GREEDY, use_tqdm=False)
    assert _all_blocks_free(llm.llm_engine) and not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("hello world", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_grammar_fault_is_a_server_error_and_not_cached(llm, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "GRAMBOOM"]))
    monkeypatch.setenv(ENV, "grammar=GRAMBOOM")
    for _ in range(2):  # compiled (and failing) again: the failure is not cached as a bad spec
        with pytest.raises(RuntimeError, match="Grammar compilation failed: InjectedFault") as info:
            llm.generate("pick one", params, use_tqdm=False)
        assert not isinstance(info.value, ValueError)
    monkeypatch.delenv(ENV)
    assert llm.generate("pick one", params, use_tqdm=False)[0].outputs[0].text in ("alpha", "GRAMBOOM")
    assert _all_blocks_free(llm.llm_engine)


# ------------------------------------------------------------------ over HTTP
# One server for every HTTP case. It runs one sequence per step, so step numbers are fixed by
# the requests sent: the step test comes first in this file and sends the server's first requests.
SERVER_FAULTS = "step=20,step=30,tokenizer=TOKBOOM,grammar=GRAMBOOM,adapter_load=doomed"


@pytest.fixture(scope="module")
def server(llama_dir, adapters):
    args = ["--served-model-name", "tiny", "--max-model-len", "128", "--max-num-seqs", "1", "--enable-lora",
            "--max-lora-rank", "8", "--lora-modules", f"lora_qkv={adapters['lora_qkv']}",
            "--allowed-lora-root", os.path.dirname(adapters["lora_all"])]
    env = {ENV: SERVER_FAULTS, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with RemoteOpenAIServer(llama_dir, args, env=env) as remote:
        yield remote


def _completion(prompt: str, max_tokens: int, **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}


def _post_in_background(url: str, bodies: list[dict]) -> tuple[ThreadPoolExecutor, list[Future]]:
    pool = ThreadPoolExecutor(len(bodies))
    return pool, [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60) for body in bodies]


def _wait(queued: tuple[ThreadPoolExecutor, list[Future]]) -> list[httpx.Response]:
    pool, futures = queued
    try:
        return [future.result(timeout=60) for future in futures]
    finally:
        pool.shutdown()


def _assert_server_error(response: httpx.Response, text: str) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError" and text in error["message"], error


def _assert_idle_and_healthy(server: RemoteOpenAIServer) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = server.metrics()
    assert metrics["vllm:kv_cache_free_blocks"] == metrics["vllm:kv_cache_total_blocks"] > 0  # no leaked block


def test_http_step_fault_fails_its_requests_and_the_server_keeps_serving(server):
    # The stream's prefill is step 1 and it fails at step 20; the two requests queued behind it
    # run steps 21-28; the next request fails at step 30.
    with httpx.Client(base_url=server.url, timeout=60) as http:
        queued, events = None, []
        with http.stream("POST", "/v1/completions", json=_completion("hello", 40, stream=True)) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 1 and queued is None:  # the stream runs: queue two behind it
                    queued = _post_in_background(server.url, [_completion("hello world", 4), _completion("one", 4)])
        assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-2])
        assert "Injected fault at model step 20" in json.loads(events[-2])["error"]["message"]
        for response in _wait(queued):
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        _assert_server_error(http.post("/v1/completions", json=_completion("hello", 8)),
                             "Injected fault at model step 30")
        assert http.post("/v1/completions", json=_completion("hello", 8)).json()["usage"]["completion_tokens"] == 8
    _assert_idle_and_healthy(server)


CHAT_TOKBOOM = {"model": "tiny", "messages": [{"role": "user", "content": "TOKBOOM"}], "max_tokens": 4}
CHAT_SCHEMA = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {
    "type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"GRAMBOOM": {"type": "string"}}}}}}


@pytest.mark.parametrize("path, body, text", [
    ("/v1/completions", _completion("say TOKBOOM", 4), "tokenizing the prompt"),
    ("/v1/completions", _completion("say TOKBOOM", 4, stream=True), "tokenizing the prompt"),
    ("/v1/chat/completions", CHAT_TOKBOOM, "tokenizing the prompt"),
    ("/v1/completions", _completion("pick", 4, structured_outputs={"choice": ["a", "GRAMBOOM"]}),
     "Grammar compilation failed"),
    ("/v1/chat/completions", CHAT_SCHEMA, "Grammar compilation failed"),
], ids=["completion", "completion-stream", "chat", "choice", "json-schema"])
def test_http_tokenizer_and_grammar_faults_answer_500(server, path, body, text):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        good = _post_in_background(server.url, [_completion("hello world", 6)])  # alongside the doomed one
        _assert_server_error(http.post(path, json=body), text)
        assert _wait(good)[0].json()["usage"]["completion_tokens"] == 6
    _assert_idle_and_healthy(server)


def test_http_failed_adapter_load_leaves_the_server_serving(server, adapters):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "doomed", "lora_path": adapters["lora_all"]})
        _assert_server_error(response, "Injected fault while loading LoRA adapter 'doomed'")
        assert "doomed" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert http.post("/v1/completions", json=_completion("hi", 4, model="doomed")).status_code == 404
        # The same weights under another name load and serve; so does the adapter loaded at start-up.
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "fine", "lora_path": adapters["lora_all"]})
        assert response.status_code == 200, response.text
        for model in ("fine", "lora_qkv"):
            response = http.post("/v1/completions", json=_completion("hello", 4, model=model))
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    _assert_idle_and_healthy(server)
