"""How `vllm serve` stops. A signal drains: new requests on every route get 503 with
Retry-After and an OpenAI-shaped body while the requests in flight (a stream and a whole
response) finish, then the process exits 0; past `--shutdown-timeout` those still running
end with an error (503 JSON, or an error event that closes the stream) and the process
still exits 0; a second signal exits at once, non-zero. An engine that dies (injected with
VLLM_FAULT_INJECTION=step_fatal=N) fails the request in flight and the process exits 1."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from typing import Any, Callable

import httpx
import pytest

from tests.entrypoints.utils import RemoteOpenAIServer
from vllm.entrypoints.cli.main import make_parser

MODEL = "tiny"
LONG = 480  # tokens: seconds of work for the tiny llama on two CPU cores
DRAINED = 256  # tokens of the requests that finish while draining: still over a second of work
SERVER_ARGS = ["--served-model-name", MODEL, "--max-model-len", "512"]


def _body(stream: bool, max_tokens: int = LONG, **extra: Any) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True, **extra}


class _InBackground:
    """Runs one HTTP request on a thread: a whole response, or a stream's SSE `data:` payloads."""

    def __init__(self, url: str, stream: bool, **extra: Any):
        self.url, self.stream, self.extra = url, stream, extra
        self.events: list[str] = []
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            body = _body(self.stream, **self.extra)
            if not self.stream:
                self.response = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
                return
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as response:
                self.response = response
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
        except BaseException as e:  # reported by the test
            self.error = e

    def join(self) -> "_InBackground":
        self._thread.join(timeout=120)
        assert not self._thread.is_alive() and self.error is None, self.error
        return self

    def chunks(self) -> list[dict]:
        return [json.loads(event) for event in self.events if event != "[DONE]"]


def _wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def _running(server: RemoteOpenAIServer) -> float:
    metrics = server.metrics()
    return metrics["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"]


def _start_long_requests(server: RemoteOpenAIServer, **extra: Any) -> tuple[_InBackground, _InBackground]:
    """A stream and a whole-response request, both running in the engine when this returns."""
    stream = _InBackground(server.url, stream=True, **extra)
    whole = _InBackground(server.url, stream=False, **extra)
    _wait_for(lambda: len(stream.events) > 0 and _running(server) >= 2)
    return stream, whole


def _exit_code(server: RemoteOpenAIServer, timeout: float) -> int:
    try:
        return server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {timeout}s:\n{server.output()}")


def _assert_refused_while_draining(url: str) -> None:
    for method, path, body in (("GET", "/health", None), ("POST", "/ping", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", _body(False, 4)), ("GET", "/metrics", None)):
        response = httpx.request(method, url + path, json=body, timeout=10)
        assert response.status_code == 503, (path, response.text)
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert "shutting down" in error["message"]


def test_shutdown_flags_parse():
    parser = make_parser()
    args = parser.parse_args(["serve", "m"])
    assert args.shutdown_timeout == 0  # vLLM's default: abort what is in flight at once
    assert parser.parse_args(["serve", "m", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", "--shutdown-timeout", bad])


def test_sigterm_drains_requests_in_flight_then_exits_0(llama_dir):
    server = RemoteOpenAIServer(llama_dir, [*SERVER_ARGS, "--shutdown-timeout", "60"])
    try:
        stream, whole = _start_long_requests(server, max_tokens=DRAINED)
        server.proc.send_signal(signal.SIGTERM)
        _assert_refused_while_draining(server.url)
        assert server.proc.poll() is None  # still serving what it accepted

        stream.join()
        whole.join()
        assert stream.response.status_code == 200 and stream.events[-1] == "[DONE]"
        chunks = stream.chunks()
        assert sum(1 for c in chunks for _ in c["choices"]) == DRAINED
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert whole.response.status_code == 200, whole.response.text
        assert whole.response.json()["usage"]["completion_tokens"] == DRAINED
        assert _exit_code(server, 30) == 0, server.output()
        assert "Traceback" not in server.output()
    finally:
        server.close()


def test_requests_past_the_shutdown_timeout_end_with_an_error(llama_dir):
    # n=4 makes each request several seconds long, far past the 0.5 s allowed.
    server = RemoteOpenAIServer(llama_dir, [*SERVER_ARGS, "--shutdown-timeout", "0.5"])
    try:
        stream, whole = _start_long_requests(server, n=4)
        sent = time.time()
        server.proc.send_signal(signal.SIGINT)  # handled as SIGTERM
        stream.join()
        whole.join()
        assert whole.response.status_code == 503, whole.response.text
        assert whole.response.json()["error"]["code"] == 503
        # The stream was cut short by an error event, not by a closed connection.
        assert stream.events[-1] == "[DONE]"
        assert stream.chunks()[-1]["error"]["code"] == 503
        assert sum(1 for c in stream.chunks() for _ in c.get("choices", ())) < 4 * LONG
        assert _exit_code(server, 30) == 0, server.output()
        assert time.time() - sent < 20
        assert "Aborting 2 request(s) still in flight" in server.output()
    finally:
        server.close()


def test_a_second_signal_exits_at_once(llama_dir):
    server = RemoteOpenAIServer(llama_dir, [*SERVER_ARGS, "--shutdown-timeout", "60"])
    try:
        stream, _ = _start_long_requests(server, n=4)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert server.proc.poll() is None  # draining
        server.proc.send_signal(signal.SIGTERM)
        assert _exit_code(server, 5) == 128 + signal.SIGTERM
        assert stream.events[-1:] != ["[DONE]"]  # cut off: the client sees an incomplete stream
    finally:
        server.close()


def test_engine_death_fails_the_request_and_exits_non_zero(llama_dir):
    env = {"VLLM_FAULT_INJECTION": "step_fatal=5"}
    server = RemoteOpenAIServer(llama_dir, SERVER_ARGS, env=env)
    try:
        stream = _InBackground(server.url, stream=True, max_tokens=50).join()
        assert stream.response.status_code == 200  # the stream had started
        chunks = stream.chunks()
        assert 0 < len(chunks) < 50 and chunks[-1]["error"]["code"] == 503
        assert _exit_code(server, 15) == 1
        output = server.output()
        assert "The engine died" in output and "the engine died; the server stopped" in output
    finally:
        server.close()
