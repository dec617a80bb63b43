"""`hermes` (Qwen 2.5/3): recorded outputs parsed whole and streamed in every split; what streaming holds back
and when; the parser's lifecycle and the per-request state."""

from __future__ import annotations

import json
import time

import pytest

from tests.entrypoints.tool_parsers import Sample, check_sample, stream
from vllm.entrypoints.openai.tool_parsers import HermesToolParser, get_tool_parser

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
NESTED_ARGS = {"query": {"filters": [{"field": "città", "op": "=", "value": "Zürich 🇨🇭"}], "limit": 5,
                         "exact": True, "boost": None, "ratio": -0.25},
               "note": 'say "hi"\n\tthen leave', "path": "C:\\tmp\\x", "tags": []}
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # a brace short

SAMPLES: list[Sample] = [
    ("single", WEATHER, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("several", WEATHER + "\n" + TIME, None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("text_before", "I'll look that up for you.\n\n" + WEATHER, "I'll look that up for you.",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("after_reasoning", "\n\n" + WEATHER + "\n", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("nested_unicode_escapes",
     "<tool_call>\n" + json.dumps({"name": "search", "arguments": NESTED_ARGS}) + "\n</tool_call>", None,
     [("search", NESTED_ARGS)]),
    ("unicode_unescaped",
     "Voilà :\n<tool_call>\n" + json.dumps({"name": "traduire", "arguments": {"texte": "日本語 ✓"}},
                                           ensure_ascii=False) + "\n</tool_call>",
     "Voilà :", [("traduire", {"texte": "日本語 ✓"})]),
    ("raw_newline_in_string",
     '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "text": "def f():\n\treturn 1\n"}}\n'
     '</tool_call>', None, [("write_file", {"path": "a.py", "text": "def f():\n\treturn 1\n"})]),
    ("end_tag_inside_string",
     '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b <tool_call>"}}</tool_call>', None,
     [("echo", {"text": "a </tool_call> b <tool_call>"})]),
    ("text_between_and_after", "Checking.\n" + WEATHER + "\nThen the time:\n" + TIME + "\nDone.",
     "Checking.\nThen the time:\nDone.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("no_close_tag_at_end", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ("no_arguments", '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),
    ("stringified_arguments", '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Boston\\"}"}</tool_call>',
     None, [("f", {"city": "Boston"})]),
    ("array_in_tags",
     '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>', None,
     [("a", {"x": 1}), ("b", {})]),
    ("no_call", "The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    ("marker_lookalikes", "Wrap it in <tool> or <tool_call_id> tags, not <tool_call",
     "Wrap it in <tool> or <tool_call_id> tags, not <tool_call", []),
    ("empty", "", "", []),
    ("malformed_json", BROKEN, BROKEN, []),
    ("truncated", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("python_quotes", "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>",
     "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>", []),
    ("not_a_call_object", '<tool_call>{"tool": "f", "args": {}}</tool_call>',
     '<tool_call>{"tool": "f", "args": {}}</tool_call>', []),
    ("arguments_not_an_object", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', []),
    ("nan_is_not_json", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("malformed_then_valid", BROKEN + "\n" + TIME, BROKEN, [("get_time", {"timezone": "Europe/Paris"})]),
    ("text_after_json_in_tag", '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>', "oops</tool_call>",
     [("f", {})]),
]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_sample_whole_and_streamed(sample):
    check_sample(HermesToolParser, sample)


def test_holds_back_a_possible_marker_and_no_more():
    parser = get_tool_parser("hermes")
    assert parser.extract_streaming("Hello <tool_").content == "Hello"  # the space might touch a call
    assert parser.extract_streaming("call>\n{\"name\": \"f\", ").content is None
    delta = parser.extract_streaming('"arguments": {"a": 1}}\n</tool_call>')
    assert delta.content is None and [(c.name, c.arguments) for c in delta.tool_calls] == [("f", '{"a": 1}')]
    assert parser.extract_streaming("\nBye").content == " Bye"  # the held space separates the two texts
    assert parser.finish() == parser.finish()  # nothing left, and finish is idempotent

    plain = get_tool_parser("hermes")
    assert plain.extract_streaming("a <b> <tool>").content == "a <b> <tool>"  # nothing to hold
    assert plain.extract_streaming(" x <").content == " x"
    assert plain.extract_streaming("/p>").content == " </p>"
    assert plain.finish().content is None


def test_call_is_sent_in_one_delta_once_complete():
    parser = get_tool_parser("hermes")
    pieces = ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}', "</tool_call>"]
    deltas = [parser.extract_streaming(p) for p in pieces] + [parser.finish()]
    sent = [(i, d.tool_calls) for i, d in enumerate(deltas) if d.tool_calls]
    assert len(sent) == 1 and sent[0][0] == 3  # after the closing brace; the closing tag is consumed later
    first = sent[0][1][0].to_openai()
    assert first["index"] == 0 and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert all(d.content is None for d in deltas)


def test_extract_tool_calls_leaves_streaming_state_alone():
    parser = get_tool_parser("hermes")
    parser.extract_streaming("Hi <tool_call>{")
    assert parser.extract_tool_calls(WEATHER).tool_calls[0].name == "get_weather"
    content, calls, _ = stream(parser, ['"name": "f"}</tool_call>'])
    assert content == "" and [c["name"] for c in calls] == ["f"]
    assert parser.extract_streaming("more").content is None  # finished: ignored


def test_ids_are_unique():
    calls = get_tool_parser("hermes").extract_tool_calls(WEATHER + TIME + WEATHER).tool_calls
    assert len({c.id for c in calls}) == 3


def test_long_arguments_stream_in_linear_time():
    text = "x" * 200_000 + '\\"' + "é" * 1000
    output = "<tool_call>" + json.dumps({"name": "write_file", "arguments": {"text": text}}) + "</tool_call>"
    start = time.perf_counter()
    content, calls, _ = stream(get_tool_parser("hermes"), [output[i:i + 4] for i in range(0, len(output), 4)])
    assert time.perf_counter() - start < 5.0
    assert content == "" and json.loads(calls[0]["arguments"]) == {"text": text}
