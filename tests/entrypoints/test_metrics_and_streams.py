"""GET /metrics (vLLM's series names), 32 concurrent streams that each match their
sequential greedy output, and a client that disconnects mid-stream: its request is
aborted and its KV blocks are freed (vllm:kv_cache_usage_perc returns to idle)."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.entrypoints.conftest import MODEL

SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:alora_reused_prompt_tokens_total",
]


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_metrics_scrape(server, client):
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert f'model_name="{MODEL}"' in response.text
    before = server.metrics()
    assert all(name in before for name in SERIES), [n for n in SERIES if n not in before]
    client.completions.create(model=MODEL, prompt="one two three", max_tokens=5, temperature=0.0,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 1
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 4
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    # Idle: every block is free again (cached blocks count as free: they can be evicted).
    assert after["vllm:kv_cache_free_blocks"] == after["vllm:kv_cache_total_blocks"] > 0


def test_lora_requests_info_names_running_adapters(server, client):
    def info_lines() -> list[str]:
        return [line for line in httpx.get(server.url + "/metrics").text.splitlines()
                if line.startswith("vllm:lora_requests_info{")]

    [idle] = info_lines()
    assert 'max_lora="2"' in idle and 'running_lora_adapters=""' in idle
    stream = client.completions.create(model="lora_all", prompt="one two three", max_tokens=400, stream=True,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running now
    try:
        assert _wait_for(lambda: any('running_lora_adapters="lora_all"' in line for line in info_lines()))
    finally:
        stream.close()


def test_32_concurrent_streams_match_sequential(server, client):
    prompts = [f"Request {i}: the quick brown fox number {i * 7} jumps" for i in range(32)]
    params = dict(model=MODEL, temperature=0.0, max_tokens=16, extra_body={"ignore_eos": True})
    sequential = [client.completions.create(prompt=p, **params).choices[0].text for p in prompts]

    async def stream(async_client, prompt):
        chunks = await async_client.completions.create(prompt=prompt, stream=True, **params)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def run_all():
        async_client = server.async_client()
        return await asyncio.gather(*(stream(async_client, p) for p in prompts))

    concurrent = asyncio.run(run_all())
    assert concurrent == sequential


def test_disconnect_mid_stream_frees_blocks(server, client):
    def metric(name):
        return server.metrics()[name]

    assert _wait_for(lambda: metric("vllm:num_requests_running") == 0)
    idle_usage = metric("vllm:kv_cache_usage_perc")
    aborted_before = _aborts(server)
    # n=4 long greedy streams: far more work than the few chunks read before disconnecting
    stream = client.completions.create(model=MODEL, prompt="hello", n=4, max_tokens=480, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    during = server.metrics()
    stream.close()
    assert during["vllm:num_requests_running"] >= 1 and during["vllm:kv_cache_usage_perc"] > idle_usage
    assert during["vllm:kv_cache_free_blocks"] < during["vllm:kv_cache_total_blocks"]
    assert _wait_for(lambda: _aborts(server) == aborted_before + 1), "the request was not aborted"
    assert _wait_for(lambda: metric("vllm:kv_cache_usage_perc") == idle_usage)
    assert metric("vllm:kv_cache_free_blocks") == metric("vllm:kv_cache_total_blocks")  # no leaked block
    assert metric("vllm:num_requests_running") == 0
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).usage.completion_tokens


def test_disconnect_while_waiting_for_whole_response(server):
    """A non-streaming client that times out is aborted too (its handler is cancelled)."""
    aborted_before = _aborts(server)
    body = {"model": MODEL, "prompt": "hello", "n": 4, "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.05)
    except httpx.TimeoutException:
        pass
    assert _wait_for(lambda: _aborts(server) == aborted_before + 1)
    assert _wait_for(lambda: server.metrics()["vllm:kv_cache_usage_perc"] == 0)


def _aborts(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort series")
