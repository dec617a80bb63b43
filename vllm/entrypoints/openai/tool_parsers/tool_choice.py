"""`tool_choice="required"` and a named function: the JSON schemas that constrain decoding, and the readers
that turn the constrained output into tool calls (whole, or streamed through the `ToolParser` API).

What it owns, mirroring vLLM:
- `required`: the output is a JSON array (at least one item; at most one with `parallel_tool_calls=False`)
  of `{"name": <one tool's name>, "parameters": <that tool's arguments>}`; `anyOf` has one branch per tool,
  so each call's arguments follow its own tool's `parameters` schema. Every tool's `$defs` are hoisted to
  the root (where its `#/$defs/...` references resolve); two tools defining one name differently is an error.
- a named function: the output is the function's arguments object itself, its `parameters` schema.

Invariants:
- Schemas are built from copies: the request's tools are never modified. A tool without parameters takes
  `{"type": "object", "properties": {}}` (its arguments are `{}`), as in vLLM.
- `parse_required_output` and `RequiredOutputParser` are one computation (`call_stream`'s): each array
  item's call starts once its name is complete and its arguments stream as they are generated, so output
  cut short by `max_tokens` keeps its complete calls and the arguments streamed of the last one; what
  cannot continue the array is dropped, and the output is never content. A named call's arguments are the
  output text verbatim, streamed as it comes (as vLLM does).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from vllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    Step,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
    skip_ws,
)
from vllm.entrypoints.openai.tool_parsers.call_stream import MORE, WAIT, CallStream

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `function` of each OpenAI tool (`{"type": "function", "function": {...}}`, or the bare function)."""
    functions = [tool.get("function", tool) if isinstance(tool, dict) else None for tool in tools or []]
    if not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions):
        raise ValueError("Each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}.")
    return functions  # type: ignore[return-value]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(function.get("parameters") or EMPTY_PARAMETERS)


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The schema of `tool_choice="required"` output."""
    functions = _functions(tools)
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one tool in `tools`.")
    branches, defs = [], {}
    for function in functions:
        parameters = _parameters(function)
        for name, schema in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"Tool definition '{name}' has multiple schemas, which is not supported.")
            defs[name] = schema
        branches.append({
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The schema of the output when `tool_choice` names a function: that function's parameters."""
    for function in _functions(tools):
        if function["name"] == name:
            return _parameters(function)
    raise ValueError(f"Tool '{name}' has not been passed in `tools`.")


def parse_required_output(text: str) -> list[ToolCall]:
    """The calls of `tool_choice="required"` output (empty when none is complete)."""
    return RequiredOutputParser().extract_tool_calls(text).tool_calls


def named_output_call(name: str, text: str) -> ToolCall:
    """The call of output constrained to the named function's arguments."""
    return ToolCall.create(name, text)


class RequiredOutputParser(ToolParser):
    """Reads the array `required_schema` constrains, streaming each call's arguments as they are generated."""

    name = "required"

    def __init__(self, tokenizer: Any = None):
        super().__init__(tokenizer)
        self._calls: Optional[CallStream] = None  # the array, once its `[` has come
        self._done = False  # the array ended, or this is not the constrained shape: the rest is ignored

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        extracted = super().extract_tool_calls(model_output)
        extracted.content = None  # as when streamed: constrained output is never content
        return extracted

    def _step(self, buf: str, final: bool) -> Step:
        if self._done:
            return len(buf), []
        if self._calls is None:
            pos = skip_ws(buf, 0)
            if pos == len(buf):
                return (pos, []) if final else None
            if buf[pos] != "[":
                self._done = True
                return len(buf), []
            self._calls = CallStream(pos, objects=False)
        outcome, pos, events = self._calls.advance(buf, final)
        if outcome == WAIT:
            return None
        if outcome == MORE:
            self._calls.shift(pos)
            return (pos, events) if pos or events else None
        self._done = True  # DONE, BROKEN or NOT_A_CALL: whatever follows is not a call
        return len(buf), events


class NamedOutputParser(ToolParser):
    """Streams output constrained to one named function's arguments as that call's argument fragments."""

    name = "named"

    def __init__(self, function_name: str, tokenizer: Any = None):
        super().__init__(tokenizer)
        self.function_name = function_name
        self._id: Optional[str] = None

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        call = named_output_call(self.function_name, model_output)
        return ExtractedToolCalls(tools_called=True, tool_calls=[call], content=None)

    def extract_streaming(self, delta_text: str) -> StreamDelta:
        if self._finished or (not delta_text and self._id is not None):
            return StreamDelta()
        if self._id is None:
            self._id = make_tool_call_id()
            return StreamDelta(tool_calls=[ToolCallDelta(0, self._id, self.function_name, delta_text)])
        return StreamDelta(tool_calls=[ToolCallDelta(0, None, None, delta_text)])

    def finish(self) -> StreamDelta:
        delta = self.extract_streaming("") if self._id is None else StreamDelta()  # the call, even when empty
        self._finished = True
        return delta
