"""Request and response bodies of POST /v1/responses (OpenAI's Responses API, text only).

What it owns: the request schema and what its fields mean on this server (the
conversation handed to the chat template, the structured-output constraint of
`text.format`, the template's `reasoning_effort`), the refusals of what the server does
not do, and the `response` object with its output items.

Invariants:
- `input` becomes chat messages exactly as /v1/chat/completions takes them: a string is
  one user turn; message items keep their role (custom roles too, e.g. an aLoRA's
  `certainty` turn) and their text parts are joined with no separator, as the chat
  endpoint joins text parts. `instructions` is a system message placed first.
  `reasoning` items in `input` are dropped (chat templates drop past thinking); any
  other item type, and non-text parts, are a 400.
- Refused with 400, naming the field: non-empty `tools` (function tools in /v1/responses
  are out of scope), `previous_response_id` (nothing is stored: send the whole
  conversation), `background: true`, an unknown or malformed `text.format`.
  `store` is accepted and has no effect (nothing is stored, as vLLM without its store).
- Unknown fields are ignored, as on every other route.
- Response bodies serialise every field (null included), as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator

from vllm.entrypoints.openai.protocol import OpenAIBaseModel
from vllm.sampling_params import StructuredOutputsParams

_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    """OpenAI's id style: `resp_...`, `msg_...`, `rs_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_of(i: int, item: Any) -> Optional[dict[str, str]]:
    """One input item as a chat message (None: an item that is dropped)."""
    if not isinstance(item, dict):
        raise ValueError(f"input[{i}] must be an object with 'role' and 'content'.")
    kind = item.get("type", "message")
    if kind == "reasoning":
        return None
    if kind != "message":
        raise ValueError(f"input[{i}] has type {kind!r}: only message items (role and content) are supported.")
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"input[{i}] must have a string 'role'.")
    if content is None or isinstance(content, str):
        return {"role": role, "content": content or ""}
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].content must be a string or a list of text parts.")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"input[{i}].content[{j}] has type {kind!r}: only input_text and output_text parts "
                             "are supported.")
    return {"role": role, "content": "".join(texts)}


def _constraint_of(fmt: dict[str, Any]) -> Optional[StructuredOutputsParams]:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("text.format.schema must be a JSON schema object for type 'json_schema'.")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"text.format.type must be one of 'text', 'json_schema', 'json_object'; got {kind!r}.")


class ResponsesRequest(OpenAIBaseModel):
    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    background: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Union[str, list[Any]]) -> Union[str, list[Any]]:
        if isinstance(value, list):
            if not value:
                raise ValueError("input must be a string or a non-empty list of message items.")
            for i, item in enumerate(value):
                _message_of(i, item)
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: Optional[list[Any]]) -> Optional[list[Any]]:
        if value:
            raise ValueError("tools are not supported by /v1/responses on this server (function tools are out of "
                             "scope for now); use /v1/chat/completions for tool calling.")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _check_previous(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            raise ValueError("previous_response_id is not supported: this server does not store responses. Send the "
                             "whole conversation in `input`.")
        return value

    @field_validator("background")
    @classmethod
    def _check_background(cls, value: Optional[bool]) -> Optional[bool]:
        if value:
            raise ValueError("background responses are not supported (nothing is stored); leave `background` unset.")
        return value

    @field_validator("text")
    @classmethod
    def _check_text(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        fmt = (value or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise ValueError("text.format must be an object with a 'type'.")
            _constraint_of(fmt)
        return value

    @field_validator("reasoning")
    @classmethod
    def _check_reasoning(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        effort = (value or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise ValueError(f"reasoning.effort must be a string, got {effort!r}.")
        return value

    def messages(self) -> list[dict[str, str]]:
        """The conversation for the chat template (instructions first, as a system message)."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return head + [{"role": "user", "content": self.input}]
        return head + [m for i, item in enumerate(self.input) if (m := _message_of(i, item)) is not None]

    @property
    def text_format(self) -> dict[str, Any]:
        return (self.text or {}).get("format") or {"type": "text"}

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        return _constraint_of(self.text_format)

    @property
    def reasoning_effort(self) -> Optional[str]:
        return (self.reasoning or {}).get("effort")

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """What reaches the chat template besides the messages (vLLM's `reasoning_effort`)."""
        effort = self.reasoning_effort
        return None if effort is None else {"reasoning_effort": effort}


# ------------------------------------------------------------------ response
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: str  # "in_progress" | "completed" | "incomplete"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The thinking text split out by the server's --reasoning-parser."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> "ResponseUsage":
        return cls(input_tokens=input_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                   output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
                   total_tokens=input_tokens + output_tokens)


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str  # "in_progress" | "completed" | "incomplete"
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: Optional[dict[str, Any]] = None
    model: str
    output: list[Union[ReasoningItem, OutputMessage]] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    temperature: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: Optional[float] = None
    truncation: str = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
