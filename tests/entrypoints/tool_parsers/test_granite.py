"""`granite`: Granite 3.0 (`<|tool_call|>[...]`, or the bare array once the special token is skipped),
3.1-3.3 (`<tool_call>[...]`) and 4.x (`<tool_call>{...}</tool_call>` per call), parsed whole and streamed
in every split."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.tool_parsers import Sample, check_sample
from vllm.entrypoints.openai.tool_parsers import GraniteToolParser, get_tool_parser

BOSTON = {"location": "Boston, MA", "unit": "fahrenheit"}
CALLS_3X = '[{"name": "get_current_weather", "arguments": {"location": "Boston, MA", "unit": "fahrenheit"}}, ' \
           '{"name": "get_stock_price", "arguments": {"ticker": "IBM"}}]'
EXPECTED_3X = [("get_current_weather", BOSTON), ("get_stock_price", {"ticker": "IBM"})]
G4_WEATHER = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston, MA", ' \
             '"unit": "fahrenheit"}}\n</tool_call>'
G4_STOCK = '<tool_call>\n{"name": "get_stock_price", "arguments": {"ticker": "IBM"}}\n</tool_call>'
NESTED = {"filter": {"and": [{"lang": "fr"}, {"title": "L'été \"chaud\" ☀"}]}, "limit": 3, "path": "a\\b"}

SAMPLES: list[Sample] = [
    ("g30_special_token", "<|tool_call|>" + CALLS_3X, None, EXPECTED_3X),
    ("g30_special_token_skipped", CALLS_3X, None, EXPECTED_3X),
    ("g30_skipped_leading_space", " \n" + CALLS_3X + "\n", None, EXPECTED_3X),
    ("g31_string_marker", "<tool_call>" + CALLS_3X, None, EXPECTED_3X),
    ("g33_with_close_tag", "<tool_call>" + CALLS_3X + "</tool_call>", None, EXPECTED_3X),
    ("both_markers", "<|tool_call|><tool_call>" + CALLS_3X, None, EXPECTED_3X),
    ("g4_single", G4_WEATHER, None, [("get_current_weather", BOSTON)]),
    ("g4_several", G4_WEATHER + "\n" + G4_STOCK, None, EXPECTED_3X),
    ("g4_text_before", "Let me check both for you.\n" + G4_WEATHER + "\n" + G4_STOCK,
     "Let me check both for you.", EXPECTED_3X),
    ("g3_text_before", "Sure!<tool_call>" + CALLS_3X, "Sure!", EXPECTED_3X),
    ("nested_unicode_escapes",
     "<tool_call>" + json.dumps([{"name": "search", "arguments": NESTED}], ensure_ascii=False), None,
     [("search", NESTED)]),
    ("no_call", "Boston is sunny today, 75°F.", "Boston is sunny today, 75°F.", []),
    ("json_array_answer", "[1, 2, 3]", "[1, 2, 3]", []),
    ("bracket_text", "[Note] The tool list is empty.", "[Note] The tool list is empty.", []),
    ("array_of_non_calls", '[{"city": "Boston"}]', '[{"city": "Boston"}]', []),
    ("empty_array", "<|tool_call|>[]", "<|tool_call|>[]", []),
    # Once a call has started it stands; what cannot continue the array is text again.
    ("malformed_array", '<tool_call>[{"name": "f", "arguments": {"a": 1}]', "]", [("f", {"a": 1})]),
    ("one_bad_item", '<tool_call>[{"name": "f", "arguments": {}}, {"arguments": {}}]', '{"arguments": {}}]',
     [("f", {})]),
    ("bad_first_item", '<tool_call>[{"arguments": {}}, {"name": "f", "arguments": {}}]',
     '<tool_call>[{"arguments": {}}, {"name": "f", "arguments": {}}]', []),
    ("truncated", '<|tool_call|>[{"name": "get_current_weather", "arguments": {"loc', None,
     [("get_current_weather", '{"loc')]),
    ("truncated_between_items", '<|tool_call|>[{"name": "f", "arguments": {}}, {"name": "g', '{"name": "g',
     [("f", {})]),
    ("marker_then_text", "<|tool_call|>I cannot call tools.", "<|tool_call|>I cannot call tools.", []),
]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_sample_whole_and_streamed(sample):
    check_sample(GraniteToolParser, sample)


def test_bare_array_only_at_the_start():
    text = "Here: " + CALLS_3X
    assert get_tool_parser("granite").extract_tool_calls(text).content == text
    assert get_tool_parser("hermes").extract_tool_calls(CALLS_3X).content == CALLS_3X  # granite-only


def test_held_back_while_undecided():
    parser = get_tool_parser("granite")
    assert parser.extract_streaming("  ").content is None  # leading space: could precede a bare array
    assert parser.extract_streaming("[").content is None
    assert parser.extract_streaming("1").content == "  [1"  # not a call list: released at once
    assert parser.finish().content is None
