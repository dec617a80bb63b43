"""Argument streaming on random values: whatever the model writes (JSON with or without escapes and
indentation, Python literals with any quoting), and however the text is cut into deltas, a call's argument
pieces concatenate to exactly `json.dumps(arguments, ensure_ascii=False)`, its first delta has the id and
name and the later ones only the next piece; and the pieces are sent as the text arrives, not at the end."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.entrypoints.tool_parsers import splits, stream
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.entrypoints.openai.tool_parsers.tool_choice import RequiredOutputParser

ALPHABET = ['a', 'Z', ' ', '"', "'", "\\", "/", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "☀", "😀", "\u2028",
            "\ud83d", "}", "]", ")", ",", ":", "=", "<tool_call>"]


def random_value(rng: random.Random, depth: int = 0, python: bool = False) -> Any:
    kinds = ["str", "int", "float", "bool", "none"] + (["list", "dict"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds + (["tuple"] if python and depth < 3 else []))
    if kind == "str":
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.choice([0, -1, 7, 10**20, -(2**63)])
    if kind == "float":
        return rng.choice([0.5, -2.25e-7, 1e16, 3.0, -0.0, 123456.789])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    items = [random_value(rng, depth + 1, python) for _ in range(rng.randint(0, 3))]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    return {f"k{i}{rng.choice(ALPHABET)}": item for i, item in enumerate(items)}


def jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def check_streams(make_parser, text: str, expected: str, rng: random.Random, every_split: bool = False) -> None:
    whole = make_parser().extract_tool_calls(text)
    assert [c.arguments for c in whole.tool_calls] == [expected], text
    chunkings = list(splits(text)) if every_split else [list(text)] + [
        [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)], strict=True)]
        for cuts in (sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 8))) for _ in range(3))]
    for chunks in chunkings:
        _, calls, _ = stream(make_parser(), chunks)
        assert [c["arguments"] for c in calls] == [expected], (text, chunks)


@pytest.mark.parametrize("seed", range(4))
def test_json_arguments(seed):
    rng = random.Random(seed)
    for _ in range(40):
        arguments = {f"p{i}": random_value(rng) for i in range(rng.randint(0, 3))}
        written = json.dumps(arguments, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        expected = json.dumps(arguments, ensure_ascii=False)
        check_streams(lambda: get_tool_parser("hermes"),
                      '<tool_call>{"name": "f", "arguments": ' + written + "}</tool_call>", expected, rng)
        check_streams(lambda: get_tool_parser("llama3_json"), '{"name": "f", "parameters": ' + written + "}",
                      expected, rng)
        check_streams(RequiredOutputParser, '[{"name": "f", "parameters": ' + written + "}]", expected, rng)


@pytest.mark.parametrize("seed", range(4))
def test_python_arguments(seed):
    rng = random.Random(seed)
    for _ in range(40):
        arguments = {f"p{i}": random_value(rng, python=True) for i in range(rng.randint(0, 3))}
        written = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        check_streams(lambda: get_tool_parser("pythonic"), f"[f({written})]",
                      json.dumps(jsonable(arguments), ensure_ascii=False), rng)


def test_every_split_of_a_call_in_every_format():
    rng = random.Random(0)
    arguments = {"city": "São Paulo", "days": [1, 2.5], "opts": {"unit": "°C", "raw": None}}
    expected = json.dumps(arguments, ensure_ascii=False)
    for name, text in [("hermes", "<tool_call>" + json.dumps({"name": "f", "arguments": arguments}) + "</tool_call>"),
                       ("granite", "<|tool_call|>" + json.dumps([{"name": "f", "arguments": arguments}])),
                       ("llama3_json", "<|python_tag|>" + json.dumps({"name": "f", "parameters": arguments})),
                       ("pythonic", f"[f(city='São Paulo', days=(1, 2.5), opts={arguments['opts']!r})]")]:
        check_streams(lambda: get_tool_parser(name), text, expected, rng, every_split=True)  # noqa: B023


def test_pythonic_streams_as_generated():
    parser = get_tool_parser("pythonic")
    pieces = ["[get_weather(", "city='San ", "Francisco', ", "days=1", "4, t=(", "1", ", 2)", ")]"]
    sent = [[c.to_openai() for c in parser.extract_streaming(p).tool_calls] for p in pieces] + [
        [c.to_openai() for c in parser.finish().tool_calls]]
    assert sent[0] == []  # `[get_weather(` could still be text: `[f("positional")]` is
    assert sent[1][0]["function"] == {"name": "get_weather", "arguments": '{"city": "San '}
    # A string ends once no adjacent literal follows, a number once what ends it comes, a parenthesis once
    # it shows whether it is a tuple.
    assert [s[0]["function"]["arguments"] if s else None for s in sent[2:]] == [
        'Francisco"', ', "days": ', '14, "t": ', None, "[1, 2]", "}", None]
