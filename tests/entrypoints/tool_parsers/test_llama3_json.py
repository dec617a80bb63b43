"""`llama3_json`: Llama 3.x JSON calls (optional `<|python_tag|>`, `;`-separated objects, `parameters` or
`arguments`), parsed whole and streamed in every split."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.tool_parsers import Sample, check_sample
from vllm.entrypoints.openai.tool_parsers import Llama3JsonToolParser, get_tool_parser

WEATHER = '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "fahrenheit"}}'
SF = {"city": "San Francisco", "unit": "fahrenheit"}
SEARCH = '{"name": "web_search", "parameters": {"query": "Llama 3.1 release date"}}'
NESTED = {"order": {"items": [{"sku": "A-1", "qty": 2}, {"sku": "Ω-9", "qty": 1}], "gift": False},
          "message": 'Joyeux anniversaire, "Zoë" 🎂', "regex": "\\d+\\.\\d*"}

SAMPLES: list[Sample] = [
    ("python_tag", "<|python_tag|>" + WEATHER, None, [("get_weather", SF)]),
    ("bare_object", WEATHER, None, [("get_weather", SF)]),
    ("leading_whitespace", "\n  " + WEATHER + "\n", None, [("get_weather", SF)]),
    ("several", "<|python_tag|>" + WEATHER + "; " + SEARCH, None,
     [("get_weather", SF), ("web_search", {"query": "Llama 3.1 release date"})]),
    ("several_no_tag", WEATHER + ";\n" + SEARCH + ";", None,
     [("get_weather", SF), ("web_search", {"query": "Llama 3.1 release date"})]),
    ("arguments_key", '{"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    ("empty_parameters", '{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ("nested_unicode_escapes", "<|python_tag|>" + json.dumps({"name": "place_order", "parameters": NESTED}), None,
     [("place_order", NESTED)]),
    ("text_before_tag", "Let me search for that. <|python_tag|>" + SEARCH, "Let me search for that.",
     [("web_search", {"query": "Llama 3.1 release date"})]),
    ("text_after", WEATHER + "\n\nI asked for Fahrenheit.", "I asked for Fahrenheit.", [("get_weather", SF)]),
    ("no_call", "San Francisco is usually mild.", "San Francisco is usually mild.", []),
    ("json_answer", '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),
    ("json_answer_then_call_shape",  # a `{` after the start is text, even when it looks like a call
     "Here you go: " + WEATHER, "Here you go: " + WEATHER, []),
    ("curly_text", "{curly} braces", "{curly} braces", []),
    ("malformed", '{"name": "get_weather", "parameters": {"city": "SF"]}', "]}", [("get_weather", '{"city": "SF"')]),
    ("truncated", "<|python_tag|>" + WEATHER[:40], None, [("get_weather", '{"')]),
    ("truncated_before_arguments", "<|python_tag|>" + WEATHER[:36], "<|python_tag|>" + WEATHER[:36], []),
    ("arguments_first", '{"parameters": {"q": "x"}, "name": "search"}', None, [("search", {"q": "x"})]),
    ("tag_then_text", "<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ("second_malformed", WEATHER + '; {"name": "x", "parameters": ', '; {"name": "x", "parameters": ',
     [("get_weather", SF)]),
]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_sample_whole_and_streamed(sample):
    check_sample(Llama3JsonToolParser, sample)


def test_llama4_json_is_the_same_format():
    assert type(get_tool_parser("llama4_json")) is Llama3JsonToolParser


def test_an_object_is_decided_when_it_closes():
    parser = get_tool_parser("llama3_json")
    assert parser.extract_streaming('{"name": "Ada", "age"').content is None  # could still be a call
    assert parser.extract_streaming(": 36}").content == '{"name": "Ada", "age": 36}'
    assert parser.extract_streaming(" ok").content == " ok"
