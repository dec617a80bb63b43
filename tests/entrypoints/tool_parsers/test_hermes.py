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
    ("stringified_arguments_truncated", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1', '"{\\"a\\": 1',
     [("f", "")]),
    ("stringified_arguments", '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Boston\\"}"}</tool_call>',
     None, [("f", {"city": "Boston"})]),
    ("array_in_tags",
     '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>', None,
     [("a", {"x": 1}), ("b", {})]),
    ("no_call", "The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    ("marker_lookalikes", "Wrap it in <tool> or <tool_call_id> tags, not <tool_call",
     "Wrap it in <tool> or <tool_call_id> tags, not <tool_call", []),
    ("empty", "", "", []),
    # A call that breaks after its name was sent stands, with the arguments sent; the rest is text again.
    ("malformed_json", BROKEN, None, [("get_weather", {"city": "Paris"})]),  # its closing tag is still dropped
    ("truncated", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None,
     [("get_weather", '{"city": "Par')]),  # cut by max_tokens: as vLLM (and OpenAI) send it
    ("truncated_in_escape", '<tool_call>{"name": "f", "arguments": {"s": "caf\\u00', '\\u00',
     [("f", '{"s": "caf')]),
    ("truncated_in_number", '<tool_call>{"name": "f", "arguments": {"n": 1.', "1.", [("f", '{"n": ')]),
    ("truncated_before_name", '<tool_call>{"name": "get_w', '<tool_call>{"name": "get_w', []),
    ("python_quotes", "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>",
     "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>", []),
    ("not_a_call_object", '<tool_call>{"tool": "f", "args": {}}</tool_call>',
     '<tool_call>{"tool": "f", "args": {}}</tool_call>', []),
    ("arguments_not_an_object", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
     "[1, 2]}</tool_call>", [("f", "")]),
    ("arguments_before_name_not_an_object", '<tool_call>{"arguments": [1], "name": "f"}</tool_call>',
     '<tool_call>{"arguments": [1], "name": "f"}</tool_call>', []),
    ("arguments_before_name", '<tool_call>{"arguments": {"a": [1, {"b": null}]}, "name": "f"}</tool_call>', None,
     [("f", {"a": [1, {"b": None}]})]),
    ("nan_is_not_json", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "NaN}}</tool_call>",
     [("f", '{"x": ')]),
    ("huge_float_is_not_json", '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',
     "1e999}}</tool_call>", [("f", '{"x": ')]),
    ("repeated_key", '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>',
     ": 2}}</tool_call>", [("f", '{"a": 1, "a"')]),
    ("numbers_and_literals", '<tool_call>{"name": "f", "arguments": {"a": -0.5e2, "b": 10, "c": [true, false, '
     'null], "d": 1E2}}</tool_call>', None, [("f", {"a": -50.0, "b": 10, "c": [True, False, None], "d": 100.0})]),
    ("extra_keys_ignored", '<tool_call>{"id": 7, "name": "f", "meta": {"x": [1]}, "parameters": {"a": 1}}'
     "</tool_call>", None, [("f", {"a": 1})]),
    ("null_arguments", '<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [("f", {})]),
    ("malformed_then_valid", BROKEN + "\n" + TIME, None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("broken_then_text_then_valid", '<tool_call>{"name": "f", "arguments": {"a": 1]} oops\n' + TIME,
     "]} oops", [("f", '{"a": 1'), ("get_time", {"timezone": "Europe/Paris"})]),
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
    first = parser.extract_streaming('"arguments": {"a": 1}}\n</tool_call>').tool_calls[0]  # named one delta ago
    assert (first.index, first.id, first.name, first.arguments) == (0, None, None, '{"a": 1}')
    assert parser.extract_streaming("\nBye").content == " Bye"  # the held space separates the two texts
    assert parser.finish() == parser.finish()  # nothing left, and finish is idempotent

    plain = get_tool_parser("hermes")
    assert plain.extract_streaming("a <b> <tool>").content == "a <b> <tool>"  # nothing to hold
    assert plain.extract_streaming(" x <").content == " x"
    assert plain.extract_streaming("/p>").content == " </p>"
    assert plain.finish().content is None


def test_arguments_stream_as_generated_and_only_what_is_settled():
    parser = get_tool_parser("hermes")
    pieces = ["<tool_call>", '{"name": "get_wea', 'ther", ', '"arguments": {"city": ', '"Par', 'is", "days": 1',
              "2, \"t\": \"caf\\u00", 'e9 \\ud83d', '\\ude00\"}', "}", "</tool_call>"]
    deltas = [parser.extract_streaming(p) for p in pieces] + [parser.finish()]
    sent = [[c.to_openai() for c in d.tool_calls] for d in deltas]
    assert sent[0] == sent[1] == [] and all(d.content is None for d in deltas)  # the name is not complete yet
    assert sent[2][0]["function"] == {"name": "get_weather", "arguments": ""} and sent[2][0]["type"] == "function"
    later = [s[0]["function"]["arguments"] if s else None for s in sent[3:]]
    # A number waits for what ends it, an escape (or a surrogate pair) until it is complete; no closing
    # quote or brace is sent before it is in the text.
    assert later == ['{"city": ', '"Par', 'is", "days": ', '12, "t": "caf', "é ", '😀"}', None, None, None]
    assert all(set(s[0]) == {"index", "function"} for s in sent[3:] if s)


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
    assert time.perf_counter() - start < 10.0  # about 2 s on one core; quadratic work would take minutes
    assert content == "" and json.loads(calls[0]["arguments"]) == {"text": text}
