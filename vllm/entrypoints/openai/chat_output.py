"""Turning a chat choice's generated text into OpenAI message fields: reasoning, content and
tool calls, whole or as stream deltas.

What it owns:
- `ToolPolicy`: what a request's `tools` / `tool_choice` / `parallel_tool_calls` mean on
  this server (vLLM's rules): no tools or `"none"` -> no parsing; `"auto"` -> the server's
  `--tool-call-parser` (a 400 without `--enable-auto-tool-choice`); `"required"` or a named
  function -> the output is constrained by a JSON schema (the grammar engine) and read as
  calls. Tools without `tool_choice` mean `"auto"` when the server parses tool calls and
  `"none"` otherwise (they still reach the chat template).
- `ChoiceParser`: one per choice. Text flows through the reasoning parser first
  (`--reasoning-parser`), and only the answer part through the tool parser.

Invariants: the streamed pieces of a choice concatenate to the fields of the same output
parsed whole; a choice that produced tool calls finishes with `finish_reason="tool_calls"`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.entrypoints.openai.errors import BadRequestError
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser
from vllm.entrypoints.openai.tool_parsers.tool_choice import (
    NamedOutputParser,
    RequiredOutputParser,
    named_schema,
    required_schema,
)
from vllm.reasoning import ReasoningParser


@dataclass
class ChoiceFields:
    """Message fields of a whole choice, or the parts of one stream delta."""

    reasoning: Optional[str] = None
    content: Optional[str] = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.reasoning is None and self.content is None and not self.tool_calls

    def then(self, later: "ChoiceFields") -> "ChoiceFields":
        """These pieces followed by `later`'s (tool calls stay stream deltas)."""
        return ChoiceFields(_join(self.reasoning, later.reasoning), _join(self.content, later.content),
                            self.tool_calls + later.tool_calls)


@dataclass(frozen=True)
class ToolPolicy:
    mode: str  # "none" | "auto" | "required" | "named"
    parser_name: Optional[str] = None  # the server's --tool-call-parser, for "auto"
    function: Optional[str] = None  # for "named"
    parallel: bool = True
    schema: Optional[dict[str, Any]] = None  # the constraint of "required" / "named"

    @classmethod
    def of(cls, tools: Optional[list[dict]], tool_choice: Any, parallel_tool_calls: Optional[bool],
           parser_name: Optional[str]) -> "ToolPolicy":
        parallel = parallel_tool_calls is not False
        if not tools and tool_choice not in (None, "none"):
            raise BadRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if not tools or tool_choice == "none" or (tool_choice is None and parser_name is None):
            return cls("none")
        if tool_choice in (None, "auto"):
            if parser_name is None:
                raise BadRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      "to be set", param="tool_choice")
            return cls("auto", parser_name=parser_name, parallel=parallel)
        try:
            if tool_choice == "required":
                return cls("required", parallel=parallel, schema=required_schema(tools, parallel))
            name = _named_function(tool_choice)
            return cls("named", function=name, parallel=parallel, schema=named_schema(tools, name))
        except ValueError as e:
            raise BadRequestError(str(e), param="tool_choice") from e

    def new_parser(self) -> Optional[ToolParser]:
        if self.mode == "auto":
            return get_tool_parser(self.parser_name)
        if self.mode == "required":
            return RequiredOutputParser()
        if self.mode == "named":
            return NamedOutputParser(self.function)
        return None


def _named_function(tool_choice: Any) -> str:
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return name
    raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {tool_choice!r}.")


class ChoiceParser:
    """Streaming split of one choice's text; `parse()` is the same split of a whole output."""

    def __init__(self, policy: ToolPolicy, reasoning: Optional[ReasoningParser], prompt: str):
        # Constrained output ("required" / named) starts at the first token: nothing to reason in.
        self._reasoning = reasoning.stream(prompt) if reasoning is not None and policy.schema is None else None
        self._tools = policy.new_parser()
        self._parallel = policy.parallel
        self.num_tool_calls = 0

    def feed(self, text: str) -> ChoiceFields:
        return self._split(text, final=False)

    def finish(self) -> ChoiceFields:
        return self._split("", final=True)

    def parse(self, text: str) -> ChoiceFields:
        """The whole message: tool-call deltas gathered into whole calls."""
        fields = self.feed(text).then(self.finish())
        fields.tool_calls = _collect_calls(fields.tool_calls)
        return fields

    def _split(self, text: str, final: bool) -> ChoiceFields:
        out = ChoiceFields()
        answer = text
        if self._reasoning is not None:
            part = self._reasoning.finish() if final else self._reasoning.extract_streaming(text)
            out.reasoning, answer = part.reasoning, part.content or ""
        if self._tools is None:
            out.content = answer or None
            return out
        delta = self._tools.extract_streaming(answer) if answer else None
        end = self._tools.finish() if final else None
        for piece in (delta, end):
            if piece is None:
                continue
            out.content = _join(out.content, piece.content)
            for call in piece.tool_calls:
                if self._parallel or call.index == 0:
                    out.tool_calls.append(call.to_openai())
                    self.num_tool_calls = max(self.num_tool_calls, call.index + 1)
        return out


def _join(a: Optional[str], b: Optional[str]) -> Optional[str]:
    return b if a is None else a if b is None else a + b


def _collect_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole calls from stream deltas (a call's first delta has its id and name)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        function = d.get("function", {})
        if d["index"] not in calls:
            calls[d["index"]] = ToolCall(d.get("id") or "", function.get("name") or "", "")
        calls[d["index"]].arguments += function.get("arguments") or ""
    return [calls[i].to_openai() for i in sorted(calls)]
