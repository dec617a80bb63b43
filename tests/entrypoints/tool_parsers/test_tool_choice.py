"""`tool_choice="required"` and named-function schemas, checked with `jsonschema` (and compiled by xgrammar,
which constrains decoding), and the readers of the constrained output, whole and streamed."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from tests.entrypoints.tool_parsers import TOOL_CALL_ID, splits, stream
from vllm.entrypoints.openai.tool_parsers.tool_choice import (
    NamedOutputParser,
    RequiredOutputParser,
    named_output_call,
    named_schema,
    parse_required_output,
    required_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "parameters": {"type": "object", "properties": {"filter": {"$ref": "#/$defs/Filter"}, "q": {"type": "string"}},
                   "required": ["q"],
                   "$defs": {"Filter": {"type": "object", "properties": {"lang": {"type": "string"}},
                                        "required": ["lang"]}}}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, SEARCH, NOW]

VALID_REQUIRED = [
    [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
    [{"name": "search", "parameters": {"q": "été", "filter": {"lang": "fr"}}}, {"name": "now", "parameters": {}}],
]
INVALID_REQUIRED = [
    [],  # at least one call
    [{"name": "get_wether", "parameters": {"city": "Paris"}}],  # unknown tool
    [{"name": "get_weather", "parameters": {"unit": "celsius"}}],  # its required argument missing
    [{"name": "get_weather", "parameters": {"q": "x"}}],  # another tool's arguments
    [{"name": "search", "parameters": {"q": "x", "filter": {}}}],  # $defs reference enforced
    [{"name": "get_weather"}],  # parameters required
    {"name": "get_weather", "parameters": {"city": "Paris"}},  # not an array
]


def test_required_schema_accepts_exactly_valid_outputs():
    schema = required_schema(TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    for output in VALID_REQUIRED:
        jsonschema.validate(output, schema)
    for output in INVALID_REQUIRED:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(output, schema)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get_weather"], ["search"],
                                                                                   ["now"]]
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == {"type": "object", "properties": {}}


def test_required_schema_without_parallel_calls_allows_one():
    schema = required_schema(TOOLS, parallel_tool_calls=False)
    assert schema["maxItems"] == 1
    jsonschema.validate(VALID_REQUIRED[0], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(VALID_REQUIRED[1], schema)


def test_required_schema_hoists_defs_without_touching_the_tools():
    tools = copy.deepcopy(TOOLS)
    schema = required_schema(tools)
    assert tools == TOOLS
    assert schema["$defs"] == {"Filter": SEARCH["function"]["parameters"]["$defs"]["Filter"]}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {}, "$defs": {"Filter": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="Filter"):
        required_schema(TOOLS + [clash])
    with pytest.raises(ValueError, match="at least one tool"):
        required_schema([])
    with pytest.raises(ValueError):
        required_schema([{"type": "function"}])


def test_named_schema_is_the_function_parameters():
    schema = named_schema(TOOLS, "get_weather")
    assert schema == WEATHER["function"]["parameters"] and schema is not WEATHER["function"]["parameters"]
    jsonschema.validate({"city": "Paris"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "extra": 1}, schema)
    jsonschema.validate({"q": "x", "filter": {"lang": "fr"}}, named_schema(TOOLS, "search"))  # own $defs
    assert named_schema(TOOLS, "now") == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="'get_time' has not been passed"):
        named_schema(TOOLS, "get_time")


def test_xgrammar_compiles_the_schemas_and_agrees():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(required_schema(TOOLS, parallel_tool_calls=False)))
    assert _is_grammar_accept_string(grammar, json.dumps(VALID_REQUIRED[0]))
    assert not _is_grammar_accept_string(grammar, json.dumps(VALID_REQUIRED[1]))
    assert not _is_grammar_accept_string(grammar, json.dumps(INVALID_REQUIRED[1]))
    grammar = xgr.Grammar.from_json_schema(json.dumps(named_schema(TOOLS, "search")))
    assert _is_grammar_accept_string(grammar, '{"filter": {"lang": "fr"}, "q": "x"}')  # in schema order
    assert not _is_grammar_accept_string(grammar, '{"filter": {}, "q": "x"}')


def test_parse_required_output():
    calls = parse_required_output(json.dumps(VALID_REQUIRED[1], ensure_ascii=False))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"q": "été", "filter": {"lang": "fr"}}),
                                                                  ("now", {})]
    assert calls[0].arguments == '{"q": "été", "filter": {"lang": "fr"}}' and TOOL_CALL_ID.match(calls[0].id)
    assert parse_required_output('[{"name": "now", "arguments": {}}]')[0].name == "now"
    truncated = '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    # Cut by max_tokens: the complete calls, and the arguments streamed of the last one (as vLLM streams them).
    assert [(c.name, c.arguments) for c in parse_required_output(truncated)] == [("now", "{}"),
                                                                                  ("get_weather", '{"ci')]
    assert [c.name for c in parse_required_output('[{"name": "now", "parameters": {}}, {"nam')] == ["now"]
    for garbage in ["", "I cannot", "{}", "[1]", '[{"parameters": {}}]', "[]"]:
        assert parse_required_output(garbage) == []


@pytest.mark.parametrize("text", [json.dumps(VALID_REQUIRED[1]), '\n[ {"name": "now", "parameters": {}} ,\n'
                                  '{"name": "get_weather", "parameters": {"city": "Zürich"}} ]\n'])
def test_required_output_streams_like_whole(text):
    whole = [(c.name, c.arguments) for c in parse_required_output(text)]
    assert whole
    for chunks in splits(text):
        content, calls, _ = stream(RequiredOutputParser(), chunks)
        assert content == "" and [(c["name"], c["arguments"]) for c in calls] == whole


def test_named_output():
    call = named_output_call("get_weather", '{"city": "Paris"}')
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}') and TOOL_CALL_ID.match(call.id)
    text = '{"city": "Zürich", "unit": "celsius"}'
    assert NamedOutputParser("get_weather").extract_tool_calls(text).tool_calls[0].arguments == text
    parser = NamedOutputParser("get_weather")
    deltas = [parser.extract_streaming(text[i:i + 5]) for i in range(0, len(text), 5)] + [parser.finish()]
    pieces = [c.to_openai() for d in deltas for c in d.tool_calls]
    assert pieces[0]["function"]["name"] == "get_weather" and all(set(p) == {"index", "function"}
                                                                   for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == text
    empty = NamedOutputParser("now")
    assert [c.name for c in empty.finish().tool_calls] == ["now"]  # the call exists even with no output
