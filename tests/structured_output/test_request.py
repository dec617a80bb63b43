"""structured_outputs_from_request: every client field shape, conflicts and malformed input."""

from __future__ import annotations

import pytest

from vllm.structured_output import structured_outputs_from_request as build

SCHEMA = {"type": "boolean"}


def test_nothing_or_text_gives_none():
    assert build() is None
    assert build(response_format={"type": "text"}) is None
    assert build(structured_outputs={"disable_any_whitespace": True}) is None


def test_structured_outputs_forms():
    assert build(structured_outputs={"json": SCHEMA}).json == SCHEMA
    assert build(structured_outputs={"regex": "a+"}).regex == "a+"
    assert build(structured_outputs={"choice": ["0", "1"]}).choice == ["0", "1"]
    assert build(structured_outputs={"grammar": 'root ::= "a"'}).grammar == 'root ::= "a"'
    assert build(structured_outputs={"json_object": True}).json_object is True
    params = build(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True, "disable_fallback": True})
    assert params.kind == "json" and params.disable_any_whitespace
    # Unset kinds may be sent explicitly as null/false (pydantic dumps do this).
    assert build(structured_outputs={"json": SCHEMA, "regex": None, "json_object": False}).kind == "json"


def test_response_format_forms():
    assert build(response_format={"type": "json_object"}).json_object is True
    params = build(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}})
    assert params.json == SCHEMA


def test_legacy_guided_fields():
    assert build(guided_json=SCHEMA).json == SCHEMA
    assert build(guided_json='{"type": "integer"}').json == '{"type": "integer"}'
    assert build(guided_regex=r"\d+").regex == r"\d+"
    assert build(guided_choice=["answerable", "unanswerable"]).choice == ["answerable", "unanswerable"]
    assert build(guided_grammar='root ::= "a"').grammar == 'root ::= "a"'
    # Options in structured_outputs still apply to a legacy constraint.
    assert build(structured_outputs={"disable_any_whitespace": True}, guided_json=SCHEMA).disable_any_whitespace


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"structured_outputs": {"json": SCHEMA}, "guided_choice": ["a"]}, "structured_outputs, guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format, guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "exactly one"),
        ({"structured_outputs": ["json"]}, "structured_outputs must be an object"),
        ({"structured_outputs": {"jsn": SCHEMA}}, "Unknown field(s) in structured_outputs: jsn"),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": "yes"}}, "must be a boolean"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not supported"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern is not supported"),
        ({"response_format": "json"}, "response_format must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format.type must be one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
        ({"guided_choice": []}, "choice must be a non-empty list"),
        ({"guided_choice": ["a", 1]}, "choice must be a non-empty list"),
    ],
)
def test_conflicting_or_malformed(kwargs, message):
    with pytest.raises(ValueError) as info:
        build(**kwargs)
    assert message in str(info.value)
