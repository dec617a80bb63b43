"""Tool calling and reasoning output end to end, through the openai client: a chat template
that renders `tools`, `--enable-auto-tool-choice --tool-call-parser hermes`,
`--reasoning-parser qwen3`. The tiny random model is steered with a regex constraint to
write exactly the text a real model would, so parsing, finish reasons and stream deltas
are checked on real engine output; `tool_choice="required"` and a named function are
constrained by the server itself and must always give parsable calls."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.entrypoints.utils import RemoteOpenAIServer

TEMPLATE = (
    "{%- if tools %}<|start_of_role|>tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>\n{%- endif %}"
    "{%- for message in messages %}<|start_of_role|>{{ message['role'] }}<|end_of_role|>"
    "{{ message['content'] or '' }}<|end_of_text|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
REASONED = "<think>The user wants Paris.</think>It is sunny."


def regex_of(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$*+?{}[]|()" else ch for ch in text)


def steer(text: str) -> dict:
    return {"structured_outputs": {"regex": regex_of(text)}}


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("tools") / "template.jinja"
    template.write_text(TEMPLATE)
    args = ["--max-model-len", "512", "--chat-template", str(template), "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with RemoteOpenAIServer(llama_dir, args) as remote:
        yield remote


def test_tools_reach_the_template(server):
    plain = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["count"]
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, "tools": [WEATHER]}).json()["count"]
    assert with_tools > plain + 20


def test_auto_tool_call_parsed_whole_and_streamed(server):
    client = server.client()
    kwargs = dict(model=server_model(server), messages=MESSAGES, tools=[WEATHER, TIME], temperature=0,
                  extra_body=steer(CALL_TEXT))
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # vLLM's shape: the first delta names the call, later ones only extend it
                    assert d.id.startswith("chatcmpl-tool-") and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "pieces": [d.function.arguments or ""]}
                else:
                    assert d.id is None and d.function.name is None and d.function.arguments
                    calls[d.index]["pieces"].append(d.function.arguments)
            finish = c.finish_reason or finish
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert finish == "tool_calls"
    [streamed] = calls.values()
    # The arguments arrive in fragments as they are generated, and assemble to the non-streamed call.
    assert len([p for p in streamed["pieces"] if p]) > 1
    assert (streamed["name"], "".join(streamed["pieces"])) == (call.function.name, call.function.arguments)


def test_tool_choice_none_and_no_call_keep_plain_content(server):
    client = server.client()
    none = client.chat.completions.create(model=server_model(server), messages=MESSAGES, tools=[WEATHER],
                                          tool_choice="none", temperature=0, extra_body=steer(CALL_TEXT))
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls
    assert none.choices[0].message.content == CALL_TEXT


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_parsable_calls(server, parallel):
    client = server.client()
    for seed in range(3):
        out = client.chat.completions.create(model=server_model(server), messages=MESSAGES, tools=[WEATHER, TIME],
                                             tool_choice="required", parallel_tool_calls=parallel, seed=seed)
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue  # a random model may ramble inside a string until max_tokens
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert parallel or len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time")
            assert set(args) == ({"city", "days"} if call.function.name == "get_weather" else {"zone"})


def test_named_function_is_forced(server):
    client = server.client()
    kwargs = dict(model=server_model(server), messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60, seed=1,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    out = client.chat.completions.create(**kwargs)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    streamed = "".join(d.function.arguments or "" for chunk in client.chat.completions.create(stream=True, **kwargs)
                       for c in chunk.choices for d in c.delta.tool_calls or [])
    assert json.loads(streamed) == json.loads(call.function.arguments)


def test_reasoning_separated_whole_and_streamed(server):
    client = server.client()
    kwargs = dict(model=server_model(server), messages=MESSAGES, temperature=0, max_tokens=200,
                  extra_body=steer(REASONED))
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.content == "It is sunny."
    assert message.reasoning == message.reasoning_content == "The user wants Paris."
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            assert "<think>" not in content and "</think>" not in reasoning
    assert (reasoning, content) == ("The user wants Paris.", "It is sunny.")


def test_reasoning_effort_and_enable_thinking_reach_the_template(server, llama_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ reasoning_effort }}|{{ enable_thinking }}|{{ messages[0]['content'] }}")
    with RemoteOpenAIServer(llama_dir, ["--max-model-len", "256", "--chat-template", str(template)]) as remote:
        ids = httpx.post(remote.url + "/tokenize", json={"messages": MESSAGES,
                                                         "chat_template_kwargs": {"enable_thinking": False}}).json()
        text = httpx.post(remote.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
        assert text.startswith("|False|")
        client = remote.client()
        plain = client.chat.completions.create(model=llama_dir, messages=MESSAGES, max_tokens=1)
        low = client.chat.completions.create(model=llama_dir, messages=MESSAGES, max_tokens=1, reasoning_effort="low")
        assert low.usage.prompt_tokens > plain.usage.prompt_tokens  # "low" rendered in front


def test_parser_flags_are_checked_at_start(llama_dir):
    for args, message in ((["--enable-auto-tool-choice"], "requires --tool-call-parser"),
                          (["--tool-call-parser", "nope"], "Unknown tool call parser 'nope'"),
                          (["--reasoning-parser", "nope"], "Unknown reasoning parser 'nope'")):
        with pytest.raises(RuntimeError, match=message):
            RemoteOpenAIServer(llama_dir, ["--max-model-len", "128", *args], timeout=60)


def server_model(server: RemoteOpenAIServer) -> str:
    return server.client().models.list().data[0].id


def test_bad_tool_requests_keep_the_server_serving(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="cannot be combined with structured outputs"):
        client.chat.completions.create(model=server_model(server), messages=MESSAGES, tools=[WEATHER],
                                       tool_choice="required", response_format={"type": "json_object"})
    assert client.chat.completions.create(model=server_model(server), messages=MESSAGES, max_tokens=2).choices
