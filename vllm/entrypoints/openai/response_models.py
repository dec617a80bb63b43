"""Response bodies of the OpenAI-compatible API, with OpenAI's and vLLM's field names.

What it owns: the JSON shapes clients parse (the openai SDK, granite-common, mellea,
granite-io), for whole responses and for server-sent-event chunks, plus the
conversion of engine logprob dicts into vLLM's `prompt_logprobs` JSON.

Invariants: every field is serialised (null included, as OpenAI does) except in a
chat `delta`, which carries only the keys that changed (`role` once, then `content`).
Logprobs of -inf become -9999.0, the JSON-safe value OpenAI uses.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, model_serializer

from vllm.outputs import Logprob, PromptLogprobs

LOGPROB_FLOOR = -9999.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens))


def prompt_logprobs_json(prompt_logprobs: Optional[PromptLogprobs]) -> Optional[list[Optional[dict[str, Any]]]]:
    """vLLM's shape: per prompt token None or {token_id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            str(token_id): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def ranked(entry: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    """The `limit` most likely tokens of one position, best first."""
    items = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= limit]
    return sorted(items, key=lambda item: item[1].rank)[:limit]


# ------------------------------------------------------------------ completions
class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ------------------------------------------------------------------ chat
class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = LOGPROB_FLOOR
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatMessage(BaseModel):
    role: str
    content: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # The thinking text of a reasoning model (--reasoning-parser); `reasoning_content` is its older name.
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None

    @model_serializer(mode="wrap")
    def _only_set_keys(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# Characters that str.splitlines() breaks on besides \r and \n. The SSE format ends lines only
# at \r and \n, but common clients (httpx's aiter_lines, hence many SDK wrappers) split text
# with splitlines(), so a sampled U+2028 inside a JSON string would cut the event in two.
# JSON's \uXXXX escape carries the same character without the break.
_SPLITLINES_ONLY = {ord(c): f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def sse(chunk: BaseModel) -> str:
    """One server-sent event carrying a stream chunk, on one line for every line splitter."""
    return f"data: {chunk.model_dump_json().translate(_SPLITLINES_ONLY)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
