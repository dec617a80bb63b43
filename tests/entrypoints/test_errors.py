"""Malformed and invalid requests: each answered with the right 4xx and an OpenAI-shaped
error body, never a 500, and the server stays healthy and serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import INVOCATION
from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello"}]
LONG_PROMPT = "one two three four five six seven eight nine ten " * 120


def chat(**fields):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


# (id, path, JSON body or raw bytes, status, text the error message must contain)
CASES = [
    ("bad-json", CHAT, b'{"model": "tiny-llama", "messages": [', 400, "Invalid JSON"),
    ("body-not-object", CHAT, b"[1, 2, 3]", 400, ""),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("message-without-role", CHAT, chat(messages=[{"content": "hi"}]), 400, "role"),
    ("role-not-a-string", CHAT, chat(messages=[{"role": 7, "content": "hi"}]), 400, "role"),
    ("unsupported-content-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "image_url"),
    ("temperature-wrong-type", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("negative-max-tokens", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("zero-max-completion-tokens", CHAT, chat(max_completion_tokens=0), 400, "max_tokens"),
    ("top-p-2", CHAT, chat(top_p=2), 400, "top_p"),
    ("n-zero", COMPLETIONS, completion(n=0), 400, "n must be"),
    ("n-huge", CHAT, chat(n=10**6), 400, "n must be at most"),
    ("presence-penalty-range", COMPLETIONS, completion(presence_penalty=5), 400, "presence_penalty"),
    ("min-tokens-over-max", COMPLETIONS, completion(min_tokens=9), 400, "min_tokens"),
    ("unknown-model-chat", CHAT, chat(model="nope"), 404, "The model `nope` does not exist."),
    ("unknown-model-completion", COMPLETIONS, completion(model="nope"), 404, "The model `nope` does not exist."),
    ("prompt-too-long", COMPLETIONS, completion(prompt=LONG_PROMPT), 400, "maximum context length"),
    ("max-tokens-too-large", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), 400, "too large"),
    ("empty-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("prompt-wrong-type", COMPLETIONS, completion(prompt={"text": "hi"}), 400, "prompt"),
    ("token-id-out-of-vocab", COMPLETIONS, completion(prompt=[1, 2, 999999]), 400, "999999"),
    ("alora-chat-without-invocation", CHAT, chat(model="alora_certainty"), 400, "alora_certainty"),
    ("alora-completion-without-invocation", COMPLETIONS, completion(model="alora_certainty"), 400,
     INVOCATION),
    ("alora-stream-without-invocation", CHAT, chat(model="alora_certainty", stream=True), 400, "invocation"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=3), 400, "logprobs"),
    ("too-many-logprobs", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream"),
    ("logit-bias-not-a-token", COMPLETIONS, completion(logit_bias={"abc": 5}), 400, "logit_bias"),
    ("stop-token-out-of-vocab", COMPLETIONS, completion(stop_token_ids=[10**7]), 400, "stop_token_ids"),
    ("conflicting-structured-outputs", CHAT, chat(guided_choice=["a"], structured_outputs={"regex": "a+"}), 400,
     "Conflicting"),
    ("bad-json-schema", CHAT, chat(structured_outputs={"json": {"type": "no-such-type"}}), 400, ""),
    ("bad-regex", COMPLETIONS, completion(guided_regex="(unclosed"), 400, ""),
    ("seed-out-of-range", COMPLETIONS, completion(seed=2**70), 400, "seed"),
    ("template-kwargs-clash", CHAT, chat(chat_template_kwargs={"messages": []}), 400, "template"),
    ("request-chat-template", CHAT, chat(chat_template="{{ messages }}"), 400, "chat template"),
    ("suffix", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
    ("tool-choice-without-tools", CHAT, chat(tool_choice="required", tools=[]), 400, "tool_choice"),
    ("auto-tool-choice-without-parser", CHAT, chat(tool_choice="auto", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]), 400, "--enable-auto-tool-choice"),
    ("unknown-named-tool", CHAT, chat(tool_choice={"type": "function", "function": {"name": "g"}}, tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), 400, "has not been passed"),
]


@pytest.mark.parametrize("path, body, status, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_request(server, path, body, status, text):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(server.url + path, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert text in error["message"], error["message"]


def test_wrong_method_and_unknown_route(server):
    assert httpx.get(server.url + COMPLETIONS).status_code == 405
    unknown = httpx.get(server.url + "/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="invocation"):
        client.chat.completions.create(model="alora_certainty", messages=MESSAGES)


def test_server_healthy_after_bad_requests(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).usage.completion_tokens >= 1
    assert server.proc.poll() is None
    assert "Traceback" not in server.output()
