"""Hostile input over HTTP: every route fuzzed from the server's OpenAPI schema
(benchmarks/fuzz_api.py's run and checks, a short CI-sized run), the checks themselves,
and regression cases for what fuzzing found (non-finite numbers, lone surrogates, a
top_k beyond the vocabulary, non-string text parts), each answered 4xx or 2xx, never 5xx.

The server is the tiny llama with a plain LoRA and an aLoRA, `--max-model-len 64` and
`--max-num-seqs 4`, so generated requests finish in a few steps.
"""

from __future__ import annotations

import httpx
import pytest

from benchmarks.fuzz_api import check_response, fuzz, openai_error_problem, sse_problem
from tests.entrypoints.utils import RemoteOpenAIServer

MODEL = "tiny-llama"
MAX_NUM_SEQS = 4
# Positive and negative cases per route: about 250 requests in all, under a minute on 2 cores.
CI_EXAMPLES = 15


@pytest.fixture(scope="module")
def server(llama_dir, adapters):
    args = ["--served-model-name", MODEL, "--max-model-len", "64", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-logprobs", "5", "--enable-lora", "--enable-activated-lora", "--max-lora-rank", "8",
            "--lora-modules", f"lora_qkv={adapters['lora_qkv']}", f"alora_certainty={adapters['alora_certainty']}"]
    with RemoteOpenAIServer(llama_dir, args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as remote:
        yield remote


def test_fuzz_every_route(server):
    report = fuzz(server.url, CI_EXAMPLES, timeout=30.0, seed=0)
    assert report.ok, report.summary()
    routes = set(httpx.get(server.url + "/openapi.json").json()["paths"])
    assert {route.split(" ", 1)[1] for route in report.cases} == routes
    # /tokenize reads its body by hand; its schema (both forms) is what lets it be fuzzed.
    assert report.cases["POST /tokenize"] > CI_EXAMPLES
    assert any(200 in report.statuses[r] for r in ("POST /v1/completions", "POST /v1/chat/completions"))
    assert server.proc.poll() is None


COMPLETION = '{"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, %s}'
CHAT = '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, %s}'
# (id, route, raw JSON body, status, text the message must contain). Raw bodies: JSON's
# NaN/Infinity and \ud800 escapes cannot be sent by a JSON encoder.
CASES = [
    ("temperature-nan", "/v1/completions", COMPLETION % '"temperature": NaN', 400, "temperature must be a finite"),
    ("temperature-inf", "/v1/chat/completions", CHAT % '"temperature": Infinity', 400, "temperature"),
    ("top-p-nan", "/v1/responses", '{"input": "hi", "top_p": NaN}', 400, "top_p must be a finite"),
    ("penalty-inf", "/v1/completions", COMPLETION % '"presence_penalty": -Infinity', 400, "presence_penalty"),
    ("logit-bias-nan", "/v1/completions", COMPLETION % '"logit_bias": {"5": NaN}', 400, "logit_bias values"),
    ("logit-bias-huge-key", "/v1/completions", COMPLETION % ('"logit_bias": {"' + "9" * 40 + '": 1}'), 400,
     "logit_bias contains token ids outside the vocabulary"),
    ("n-huge", "/v1/completions", COMPLETION % '"n": 99999999999999999999', 400, "n must be at most"),
    ("n-over-max-num-seqs", "/v1/chat/completions", CHAT % f'"n": {MAX_NUM_SEQS + 1}', 400,
     f"max_num_seqs ({MAX_NUM_SEQS})"),
    ("max-tokens-huge", "/v1/completions", COMPLETION % '"max_tokens": 99999999999999999999', 400, "too large"),
    ("max-completion-tokens-inf", "/v1/chat/completions", CHAT % '"max_completion_tokens": 1e400', 400,
     "max_completion_tokens"),
    ("max-output-tokens-huge", "/v1/responses", '{"input": "hi", "max_output_tokens": 99999999999}', 400,
     "max_output_tokens"),
    ("logprobs-over-max", "/v1/completions", COMPLETION % '"logprobs": 6', 400, "max allowed: 5"),
    ("top-logprobs-over-max", "/v1/chat/completions", CHAT % '"logprobs": true, "top_logprobs": 6', 400,
     "max allowed: 5"),
    ("prompt-logprobs-over-max", "/v1/chat/completions", CHAT % '"prompt_logprobs": 99999999999', 400,
     "max allowed: 5"),
    ("seed-nan", "/v1/completions", COMPLETION % '"seed": NaN', 400, "seed"),
    ("surrogate-stop", "/v1/completions", COMPLETION % '"stop": ["\\ud800"]', 400, "stop.0: invalid text"),
    ("surrogate-message", "/v1/chat/completions", CHAT % '"tools": [{"x\\udfff": 1}]', 400, "tools.0"),
    ("surrogate-input", "/v1/responses", '{"input": [{"role": "user", "content": "\\ud800"}]}', 400,
     "input.0.content"),
    ("surrogate-tokenize", "/tokenize", '{"prompt": "a\\ud800"}', 400, "prompt: invalid text"),
    ("surrogate-tokenize-chat", "/tokenize", '{"messages": [{"role": "user", "content": "\\udc00"}]}', 400,
     "messages.0.content"),
    ("tokenize-wrong-type", "/tokenize", '{"prompt": 5}', 400, "prompt: Input should be a valid string"),
    ("text-part-not-a-string", "/v1/chat/completions",
     '{"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', 400,
     "'text' must be a string"),
    ("invalid-utf8", "/v1/completions", '{"model": "tiny-llama", "prompt": "\xff\xfe"}', 400, "must be UTF-8"),
    ("top-k-beyond-vocab", "/v1/completions", COMPLETION % '"top_k": 99999999999999999999', 200, ""),
    ("logit-bias-beyond-100", "/v1/completions", COMPLETION % '"logit_bias": {"5": 1e308}', 200, ""),
]


@pytest.mark.parametrize("path, raw, status, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request(server, path, raw, status, text):
    body = raw.encode("latin-1") if "\xff" in raw else raw.encode()
    response = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    assert check_response(path, status, response.headers["content-type"], response.content) is None
    if status >= 400:
        assert text in response.json()["error"]["message"], response.text


def test_server_healthy_after_hostile_input(server):
    assert httpx.get(server.url + "/health").status_code == 200
    done = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in server.output()


# ------------------------------------------------------------------ the checks themselves
ERROR = b'{"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}'


@pytest.mark.parametrize("body, problem", [
    (ERROR, None),
    (b'{"detail": "bad"}', "no 'error' object"),
    (b"not json", "body is not JSON"),
    (b'{"error": {"message": "", "type": "x", "param": null, "code": 400}}', "message"),
    (b'{"error": {"message": "m", "type": "x", "code": 400}}', "param"),
    (b'{"error": {"message": "m", "type": "x", "param": null, "code": 422}}', "code"),
])
def test_openai_error_shape(body, problem):
    found = openai_error_problem(body, 400)
    assert found is None if problem is None else problem in found


@pytest.mark.parametrize("body, problem", [
    (b'data: {"a": 1}\n\ndata: [DONE]\n\n', None),
    (b'data: {"error": {"message": "m", "type": "t", "param": null, "code": 400}}\n\ndata: [DONE]\n\n', None),
    (b'data: {"a": 1}\n\n', "[DONE]"),
    (b"data: {oops\n\ndata: [DONE]\n\n", "not JSON"),
    (b'data: {"error": {"message": "m", "type": "t", "param": null, "code": 500}}\n\ndata: [DONE]\n\n', "500"),
    (b"", "without data"),
    # The Responses API ends with a terminal event and sends no [DONE], as OpenAI's.
    (b'event: response.created\ndata: {"type": "response.created"}\n\n'
     b'event: response.completed\ndata: {"type": "response.completed"}\n\n', None),
    (b'event: response.created\ndata: {"type": "response.created"}\n\n', "response.created"),
    (b'event: error\ndata: {"type": "error", "code": "BadRequestError", "message": "m"}\n\n', None),
    (b'event: error\ndata: {"type": "error", "code": "InternalServerError", "message": "m"}\n\n', "error event"),
])
def test_sse_checks(body, problem):
    found = sse_problem(body)
    assert found is None if problem is None else problem in found


def test_check_response_kinds():
    assert check_response("/v1/completions", 500, "application/json", ERROR)[0] == "5xx"
    assert check_response("/v1/completions", 400, "application/json", b"{}")[0] == "unshaped 4xx"
    assert check_response("/v1/completions", 200, "application/json", b"{")[0] == "bad 2xx body"
    assert check_response("/v1/completions", 200, "text/plain", b"ok")[0] == "bad 2xx body"
    assert check_response("/metrics", 200, "text/plain", b"# HELP") is None
    assert check_response("/v1/completions", 200, "application/json", b"{}") is None
