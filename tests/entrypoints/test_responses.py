"""POST /v1/responses through the openai client against the shared server: the text equals
the chat completion's for the same conversation (same prompt rendering), streamed deltas
concatenate to the whole text with OpenAI's event order and sequence numbers, json_schema
output validates, max_output_tokens gives status incomplete, adapters (an aLoRA's custom
role) work, bad input is a 4xx and the server keeps serving, a disconnect aborts. Without a
server: reasoning items, whole and streamed, from a --reasoning-parser split."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.entrypoints.conftest import MODEL
from vllm.entrypoints.openai.chat_output import ChoiceParser, ToolPolicy
from vllm.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm.entrypoints.openai.serving_responses import ResponseBuilder
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.reasoning import create_reasoning_parser
from vllm.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
INSTRUCTIONS = "Answer in one word."
ITEM_ORDER = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _text(response) -> str:
    [message] = [item for item in response.output if item.type == "message"]
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    return part.text


@pytest.mark.parametrize("model, turns", [(MODEL, QUESTION), ("lora_qkv", QUESTION),
                                          ("alora_certainty", QUESTION + [{"role": "certainty", "content": ""}])])
def test_text_equals_chat_completion(client, model, turns):
    chat = client.chat.completions.create(model=model, messages=[{"role": "system", "content": INSTRUCTIONS}] + turns,
                                          temperature=0.0, max_completion_tokens=12)
    items = [{"role": t["role"], "content": [{"type": "input_text", "text": t["content"]}]} for t in turns]
    for given in ([dict(t) for t in turns], items):
        resp = client.responses.create(model=model, instructions=INSTRUCTIONS, input=given, temperature=0.0,
                                       max_output_tokens=12)
        assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == model
        assert _text(resp) == chat.choices[0].message.content and resp.output[0].id.startswith("msg_")
        assert resp.usage.input_tokens == chat.usage.prompt_tokens
        assert resp.usage.output_tokens == chat.usage.completion_tokens
        assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
        assert resp.usage.input_tokens_details.cached_tokens >= 0
        assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if model == MODEL:  # a string input is one user turn
        chat = client.chat.completions.create(model=model, messages=QUESTION, temperature=0.0, max_tokens=12)
        resp = client.responses.create(model=model, input=QUESTION[0]["content"], temperature=0.0,
                                       max_output_tokens=12)
        assert _text(resp) == chat.choices[0].message.content


def test_history_with_output_text_parts_renders_like_chat(client):
    history = QUESTION + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    chat = client.chat.completions.create(model=MODEL, messages=history, temperature=0.0, max_tokens=6)
    items = [dict(QUESTION[0]), {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                                 "content": [{"type": "output_text", "text": "Paris.", "annotations": []}]},
             {"type": "reasoning", "id": "rs_1", "summary": []}, {"role": "user", "content": "And Italy?"}]
    resp = client.responses.create(model=MODEL, input=items, temperature=0.0, max_output_tokens=6)
    assert _text(resp) == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_matches_whole(server, client):
    kwargs = dict(model=MODEL, input=QUESTION, temperature=0.0, max_output_tokens=10, metadata={"k": "v"})
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress"] + ITEM_ORDER[:2] + [d.type for d in deltas] + \
        ITEM_ORDER[3:] + [final]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(d.delta for d in deltas) == _text(whole) == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in events[3:-2])
    done = events[-1].response
    assert done.id == events[0].response.id and done.status == whole.status and _text(done) == _text(whole)
    assert done.usage.output_tokens == whole.usage.output_tokens and done.metadata == {"k": "v"}
    # the wire: named events, JSON data, no [DONE]
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")


def test_async_stream(server):
    async def run():
        client = server.async_client()
        stream = await client.responses.create(model="lora_all", input=QUESTION, stream=True, temperature=0.0,
                                               max_output_tokens=8)
        streamed = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        whole = await client.responses.create(model="lora_all", input=QUESTION, temperature=0.0, max_output_tokens=8)
        return streamed, _text(whole)

    streamed, whole = asyncio.run(run())
    assert streamed == whole


def test_max_output_tokens_gives_incomplete(client):
    resp = client.responses.create(model=MODEL, input=QUESTION, temperature=0.0, max_output_tokens=2)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[-1].status == "incomplete" and resp.usage.output_tokens == 2
    assert resp.max_output_tokens == 2


def test_json_schema(client):
    schema = {"type": "string", "enum": ["Paris", "Lyon"]}
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    resp = client.responses.create(model=MODEL, input=QUESTION, temperature=0.0, max_output_tokens=20, text=fmt)
    assert resp.status == "completed" and json.loads(_text(resp)) in schema["enum"]
    assert resp.text.format.type == "json_schema"
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0.0, max_output_tokens=20,
                                          text=fmt, stream=True))
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == _text(resp)
    obj = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5,
                                  text={"format": {"type": "json_object"}})
    assert _text(obj).strip() == "" or _text(obj).lstrip().startswith("{")


def test_parse_with_pydantic_model(client):
    class City(pydantic.BaseModel):
        name: Literal["Paris", "Lyon"]

    resp = client.responses.parse(model="alora_answerability", text_format=City, temperature=0.0,
                                  max_output_tokens=60, input=QUESTION + [{"role": "answerability", "content": ""}])
    assert resp.status == "completed" and resp.output_parsed.name in ("Paris", "Lyon")


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "nope"}, 404, "The model `nope` does not exist."),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, 400, "tools are not supported"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type must be one of"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id is not supported"),
    ({"background": True}, 400, "background responses are not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400, "only message items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input_text"),
    ({"input": []}, 400, "non-empty"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 100000}, 400, "'max_output_tokens' is too large"),
    ({"model": "alora_certainty"}, 400, "alora_certainty"),  # no invocation in the prompt
])
def test_bad_requests_are_4xx(server, client, body, status, fragment):
    full = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **body}
    for stream in (False, True):
        response = httpx.post(server.url + "/v1/responses", json={**full, "stream": stream}, timeout=30)
        assert response.status_code == status, response.text
        assert fragment in response.json()["error"]["message"]
    assert client.responses.create(model=MODEL, input="still serving", max_output_tokens=2).status


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "function", "name": "f", "parameters": {}}])


def test_disconnect_mid_stream_aborts(server, client):
    def aborts() -> float:
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line)

    before = aborts()
    # greedy, this prompt runs to the 460-token limit: far more than is read before disconnecting
    stream = client.responses.create(model=MODEL, input="Write a long story.", stream=True, temperature=0.0,
                                     max_output_tokens=460)
    assert next(e for e in stream if e.type == "response.output_text.delta").delta
    stream.close()
    deadline = time.time() + 10
    while aborts() < before + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert aborts() == before + 1
    # a non-streaming client that gives up is aborted too
    body = {"model": MODEL, "input": "Write a long story.", "temperature": 0.0, "max_output_tokens": 460}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/responses", json=body, timeout=0.05)
    deadline = time.time() + 10
    while aborts() < before + 2 and time.time() < deadline:
        time.sleep(0.05)
    assert aborts() == before + 2
    assert client.responses.create(model=MODEL, input="still serving", max_output_tokens=2).usage.output_tokens
    assert "Traceback" not in server.output()


# ------------------------------------------------------------------ without a server
def test_request_to_conversation():
    request = ResponsesRequest(input=[{"role": "user", "content": ["a", {"type": "input_text", "text": "b"}]},
                                      {"type": "reasoning", "id": "rs_1", "summary": []},
                                      {"role": "certainty", "content": None}],
                               instructions="Be brief.", reasoning={"effort": "high"}, unknown_vendor_field=1)
    assert request.messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
                                  {"role": "certainty", "content": ""}]
    assert request.template_kwargs() == {"reasoning_effort": "high"} and request.structured_outputs() is None
    assert ResponsesRequest(input="hi").template_kwargs() is None
    assert ResponsesRequest(input="x", text={"format": {"type": "json_object"}}).structured_outputs().json_object
    schema = {"type": "integer"}
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    assert ResponsesRequest(input="x", text=fmt).structured_outputs().json == schema


class _FakeStream:
    def __init__(self, pieces: list[str], finish: str):
        self.outputs = [RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(
            0, p, [7], None, None, finish if i == len(pieces) - 1 else None)], i == len(pieces) - 1)
            for i, p in enumerate(pieces)]
        self.aborted = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for output in self.outputs:
            yield output

    def abort(self):
        self.aborted = True


def _builder() -> ResponseBuilder:
    request = ResponsesRequest(input="hi", reasoning={"effort": "low"})
    parser = ChoiceParser(ToolPolicy("none"), create_reasoning_parser("qwen3"), "")
    return ResponseBuilder(request, "resp_x", "m", parser, lambda s: len(s.split()), SamplingParams())


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_reasoning_item_whole_and_streamed(finish):
    pieces = ["<thi", "nk>The user ", "wants Paris.</th", "ink>It is", " sunny."]
    merged = RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(0, "".join(pieces), [7] * 5, None, None,
                                                                         finish)], True)
    whole = _builder().whole(merged)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "The user wants Paris." and whole.output[0].id.startswith("rs_")
    assert whole.output[1].content[0].text == "It is sunny." and whole.usage.output_tokens_details.reasoning_tokens == 4
    fake = _FakeStream(pieces, finish)

    async def collect():
        return [json.loads(block.split("\ndata: ")[1]) async for block in _builder().events(fake)]

    events = asyncio.run(collect())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, content) == ("The user wants Paris.", "It is sunny.")
    kinds = [e["type"] for e in events if "delta" not in e["type"]]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done"] + ITEM_ORDER[:2] + ITEM_ORDER[3:] + \
        ["response.completed" if finish == "stop" else "response.incomplete"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["status"] == ("completed" if finish == "stop" else "incomplete")
    assert final["output"][0]["content"] == whole.model_dump()["output"][0]["content"]
    assert final["reasoning"] == {"effort": "low"} and final["usage"]["output_tokens"] == 5


def test_stream_error_becomes_error_event():
    class Failing(_FakeStream):
        async def _gen(self):
            yield self.outputs[0]
            raise RuntimeError("boom")

    fake = Failing(["Hel", "lo"], "stop")

    async def collect():
        return [json.loads(block.split("\ndata: ")[1]) async for block in _builder().events(fake)]

    events = asyncio.run(collect())
    assert events[-1]["type"] == "error" and "boom" in events[-1]["message"] and fake.aborted
    assert events[-1]["sequence_number"] == len(events) - 1
