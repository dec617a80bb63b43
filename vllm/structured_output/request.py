"""Building `StructuredOutputsParams` from the request fields clients actually send.

What it owns: the mapping from the HTTP/offline request shapes to one constraint:
- `structured_outputs: {"json"|"regex"|"choice"|"grammar"|"json_object": ...,
  "disable_any_whitespace": bool}` (vLLM >= 0.10.2; mellea, granite-common),
- `response_format: {"type": "text"|"json_object"|"json_schema", "json_schema": {"schema": ...}}`
  (OpenAI),
- the legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields
  (vLLM < 0.12; granite-io).

Invariants: at most one source may constrain a request (a `ValueError` names the
conflicting fields otherwise); a malformed field raises a `ValueError` that names it; no
constraint at all gives None. Whether a schema or regex compiles is checked later, by
`StructuredOutputManager.validate`.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.sampling_params import StructuredOutputsParams

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM options that change nothing with xgrammar: there is no fallback backend, and
# xgrammar already forbids properties a schema does not declare.
_NO_OP_OPTIONS = ("disable_fallback", "disable_additional_properties")
_UNSUPPORTED_OPTIONS = ("whitespace_pattern", "structural_tag")


def structured_outputs_from_request(
    structured_outputs: Optional[dict[str, Any]] = None,
    response_format: Optional[dict[str, Any]] = None,
    guided_json: Any = None,
    guided_regex: Optional[str] = None,
    guided_choice: Optional[list[str]] = None,
    guided_grammar: Optional[str] = None,
) -> Optional[StructuredOutputsParams]:
    """The request's single output constraint, or None when it has none."""
    forms: list[tuple[str, dict[str, Any]]] = []  # (field name, constraint)
    disable_any_whitespace = False

    if structured_outputs is not None:
        constraint, disable_any_whitespace = _from_structured_outputs(structured_outputs)
        if constraint:
            forms.append(("structured_outputs", constraint))

    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint:
            forms.append(("response_format", constraint))

    for name, kind, value in (
        ("guided_json", "json", guided_json),
        ("guided_regex", "regex", guided_regex),
        ("guided_choice", "choice", guided_choice),
        ("guided_grammar", "grammar", guided_grammar),
    ):
        if value is not None:
            forms.append((name, {kind: value}))

    if not forms:
        return None
    if len(forms) > 1:
        names = ", ".join(name for name, _ in forms)
        raise ValueError(f"Conflicting structured output constraints: {names}. Send only one of them.")
    return StructuredOutputsParams(**forms[0][1], disable_any_whitespace=disable_any_whitespace)


def _from_structured_outputs(fields: Any) -> tuple[dict[str, Any], bool]:
    if not isinstance(fields, dict):
        raise ValueError(f"structured_outputs must be an object, got {type(fields).__name__}.")
    unsupported = [k for k in _UNSUPPORTED_OPTIONS if fields.get(k) not in (None, False)]
    if unsupported:
        raise ValueError(f"structured_outputs.{unsupported[0]} is not supported by this server.")
    known = set(_KINDS) | set(_NO_OP_OPTIONS) | set(_UNSUPPORTED_OPTIONS) | {"disable_any_whitespace"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"Unknown field(s) in structured_outputs: {', '.join(unknown)}; "
            f"expected one of {', '.join(_KINDS)} (plus disable_any_whitespace)."
        )
    disable_ws = fields.get("disable_any_whitespace") or False
    if not isinstance(disable_ws, bool):
        raise ValueError(f"structured_outputs.disable_any_whitespace must be a boolean, got {disable_ws!r}.")
    constraint = {k: fields[k] for k in _KINDS if fields.get(k) not in (None, False)}
    if len(constraint) > 1:
        raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got {', '.join(constraint)}.")
    return constraint, disable_ws


def _from_response_format(response_format: Any) -> dict[str, Any]:
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}.")
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema' field.")
        schema = spec.get("schema")
        if schema is None:
            raise ValueError("response_format.json_schema.schema is required for type 'json_schema'.")
        return {"json": schema}
    raise ValueError(
        f"response_format.type must be one of 'text', 'json_object', 'json_schema'; got {kind!r}."
    )
