"""The registry, the OpenAI shapes of calls and deltas, and a seeded fuzz of every parser: text assembled from
markers, JSON and Python fragments must stream exactly as it parses whole, in any chunking, without the
parser ever failing."""

from __future__ import annotations

import random

import pytest

from tests.entrypoints.tool_parsers import TOOL_CALL_ID, stream
from vllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    GraniteToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    base,
    get_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.tool_choice import RequiredOutputParser

NOISE = [
    "<tool_call>", "</tool_call>", "<|tool_call|>", "<|python_tag|>", "<|python_start|>", "<|python_end|>",
    "<tool", "_call>", "<|", "{", "}", "[", "]", "(", ")", '"name": ', '"f"', ", ", '"arguments": ',
    '"parameters": ', "{}", '"x\\"y"', '"</tool_call>"', "\\", '"', "'", "'''", ";", " ", "\n", "Hi", "é☀",
    "f(", "a=1", "b='s'", "=", ":", "null", "true", "1e5", "NaN", "-", "1.", "\\u00e9", "\\ud83d", "\\ude00",
    "\\x4", "r'", "(1,)", "(2)", "{'k': ", '"""', "\n\t", "1_0", "0x1F", "'a' 'b'", '"name": "f", ',
]
CALLS = [  # whole calls of every format, so that each parser meets valid calls among the noise
    '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "c"}]}}</tool_call>', '<tool_call>\n{"name": "g"}\n',
    '<|tool_call|>[{"name": "f", "arguments": {}}]', '[{"name": "f", "arguments": {"x": "é"}}]',
    '{"name": "g", "parameters": {}}', '<|python_tag|>{"name": "f", "arguments": {"a": "x"}}', "; ",
    "[f(a=1), g(b='x')]", "<|python_start|>[g()]<|python_end|>", '[{"name": "f", "parameters": {"a": 1}}',
    "[f(t=(1, (2)), d={'k': [r'\\d', u\"é\"]}, s='''x''' \"y\")]", '{"parameters": {"a": [true]}, "name": "f"}',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', '{"name": "f", "arguments": {"a": -1.5e3',
]


def test_registry():
    assert set(TOOL_PARSERS) >= {"hermes", "granite", "llama3_json", "pythonic"}
    first, second = get_tool_parser("hermes"), get_tool_parser("hermes", tokenizer=object())
    assert first is not second and second.tokenizer is not None  # one parser per request
    with pytest.raises(ValueError) as error:
        get_tool_parser("mistral")
    assert "'mistral'" in str(error.value) and "granite, hermes, llama3_json" in str(error.value)


def test_openai_shapes():
    call = ToolCall.create("get_weather", '{"city": "Paris"}')
    assert TOOL_CALL_ID.match(call.id)
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert ToolCallDelta(1, call.id, "get_weather", "").to_openai() == {
        "index": 1, "id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert ToolCallDelta(1, None, None, '"}').to_openai() == {"index": 1, "function": {"arguments": '"}'}}


PARSERS = {"granite": GraniteToolParser, "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
           "pythonic": PythonicToolParser, "required": RequiredOutputParser}


@pytest.mark.parametrize("name", list(PARSERS))
def test_fuzz_streaming_equals_whole(name, monkeypatch):
    failures, with_calls = [], 0
    monkeypatch.setattr(base.logger, "exception", lambda *args: failures.append(args))
    rng = random.Random(name)
    for _ in range(1000):
        text = "".join(rng.choice(rng.choice([NOISE, CALLS])) for _ in range(rng.randint(0, 8)))
        if rng.random() < 0.3:
            text = " " * rng.randint(0, 2) + text
        whole = PARSERS[name]().extract_tool_calls(text)
        with_calls += whole.tools_called
        expected = [(c.name, c.arguments) for c in whole.tool_calls]
        for chunks in [list(text), _random_chunks(rng, text), _random_chunks(rng, text)]:
            content, calls, _ = stream(PARSERS[name](), chunks)
            assert content == (whole.content or ""), (text, chunks)
            assert [(c["name"], c["arguments"]) for c in calls] == expected, (text, chunks)
    assert not failures and with_calls > 50


def _random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]


def test_a_failing_format_returns_its_text(monkeypatch):
    class Broken(ToolParser):
        def _step(self, buf, final):
            raise RuntimeError("bug")

    monkeypatch.setattr(base.logger, "exception", lambda *args: None)
    assert Broken().extract_tool_calls("some <tool_call> text").content == "some <tool_call> text"
