"""POST /v1/chat/completions through the openai client: base model and every adapter, sync
and async, streaming and not; logprobs whose tokens concatenate to the content; the SSE
stream's shape; documents, chat_template_kwargs, custom roles, n, max_completion_tokens,
and the structured-output fields granite-common and mellea send."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.entrypoints.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# model name -> a conversation that activates it (aLoRAs: a final turn with their invocation)
MODEL_MESSAGES = {
    MODEL: QUESTION,
    "lora_qkv": QUESTION,
    "lora_all": QUESTION,
    "alora_certainty": QUESTION + [{"role": "certainty", "content": ""}],
    "alora_answerability": QUESTION + [{"role": "answerability", "content": ""}],
}
GREEDY = dict(temperature=0.0, max_completion_tokens=10, extra_body={"ignore_eos": True})


@pytest.mark.parametrize("model", list(MODEL_MESSAGES))
def test_chat_stream_matches_whole(client, model):
    whole = client.chat.completions.create(model=model, messages=MODEL_MESSAGES[model], **GREEDY)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 10 and whole.model == model
    chunks = list(client.chat.completions.create(model=model, messages=MODEL_MESSAGES[model], stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_async(server):
    async def run():
        client = server.async_client()
        whole = await client.chat.completions.create(model="lora_qkv", messages=QUESTION, **GREEDY)
        stream = await client.chat.completions.create(model="lora_qkv", messages=QUESTION, stream=True, **GREEDY)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return whole.choices[0].message.content, streamed

    whole, streamed = asyncio.run(run())
    assert whole == streamed


@pytest.mark.parametrize("model", [MODEL, "alora_certainty"])
def test_logprobs_tokens_concatenate_to_content(client, model):
    result = client.chat.completions.create(model=model, messages=MODEL_MESSAGES[model], logprobs=True,
                                            top_logprobs=5, **GREEDY)
    choice = result.choices[0]
    content = choice.logprobs.content
    assert len(content) == 10
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert abs(values[0] - entry.logprob) < 1e-5  # greedy: the choice is the most likely
        assert entry.top_logprobs[0].token == entry.token


def test_logprobs_without_top(client):
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, logprobs=True, **GREEDY)
    assert all(entry.top_logprobs == [] for entry in result.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY).choices[0].logprobs is None


def test_stream_wire_format(server):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True, "n": 2,
            "logprobs": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] is not None
        tokens = "".join(t["token"] for ch in mine[1:] for t in (ch["logprobs"] or {"content": []})["content"])
        assert tokens == "".join(ch["delta"].get("content", "") for ch in mine)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 8


def test_documents_kwargs_tools_and_custom_roles(client):
    base = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    with_docs = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1,
        extra_body={"documents": [{"doc_id": "1", "text": "Paris is the capital of France."}],
                    "chat_template_kwargs": {"unused_flag": True}, "tools": None},
    )
    assert with_docs.usage.prompt_tokens > base.usage.prompt_tokens
    empty_docs = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                                extra_body={"documents": []})
    assert empty_docs.usage.prompt_tokens == base.usage.prompt_tokens
    custom = client.chat.completions.create(model=MODEL, max_tokens=1,
                                            messages=QUESTION + [{"role": "hallucination", "content": "x"}])
    assert custom.usage.prompt_tokens > base.usage.prompt_tokens


def test_generation_prompt_controls(client):
    messages = QUESTION + [{"role": "assistant", "content": "The capital"}]
    cont = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"continue_final_message": True,
                                                      "add_generation_prompt": False})
    assert cont.choices[0].message.role == "assistant"
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body={"add_generation_prompt": False})
    assert plain.usage.prompt_tokens > cont.usage.prompt_tokens  # the template closed the last turn


def test_n_and_max_tokens_names(client):
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, temperature=1.0, seed=1,
                                            max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2] and result.usage.completion_tokens == 18
    # max_completion_tokens wins over max_tokens, as in vLLM
    both = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=9, max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert both.usage.completion_tokens == 3
    # no limit at all: bounded by max_model_len, the model stops on its own or at the limit
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.0)
    assert free.usage.total_tokens <= 512


@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"json": {"type": "boolean"}}}, lambda v: isinstance(v, bool)),
    ({"structured_outputs": {"json": {"type": "string", "enum": ["answerable", "unanswerable"]}}},
     lambda v: v in ("answerable", "unanswerable")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "enum": list(range(10))}}}}, lambda v: v in range(10)),
    ({"guided_json": {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0}},
                      "required": ["score"]}}, lambda v: v["score"] >= 0),
    ({"guided_choice": ["yes", "no"]}, None),
])
def test_structured_outputs(client, fields, check):
    # mellea / granite-common shape: adapter model, logprobs + top_logprobs, max_completion_tokens
    result = client.chat.completions.create(
        model="alora_answerability", messages=MODEL_MESSAGES["alora_answerability"], temperature=0.0,
        max_completion_tokens=40, logprobs=True, top_logprobs=10, extra_body={"documents": [], **fields},
    )
    content = result.choices[0].message.content
    assert "".join(t.token for t in result.choices[0].logprobs.content) == content
    if check is None:
        assert content in ("yes", "no")
    else:
        assert check(json.loads(content))


def test_structured_outputs_streaming(client):
    stream = client.chat.completions.create(
        model="alora_answerability", messages=MODEL_MESSAGES["alora_answerability"], temperature=0.0,
        max_completion_tokens=40, stream=True,
        extra_body={"structured_outputs": {"json": {"type": "string", "enum": ["answerable", "unanswerable"]}}},
    )
    chunks = [c for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert json.loads(content) in ("answerable", "unanswerable")
    assert chunks[-1].choices[0].finish_reason == "stop"
