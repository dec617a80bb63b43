"""Tool-call parsing: the types every format shares, and the engine that streams them.

What it owns: `ToolCall`, `ExtractedToolCalls`, `ToolCallDelta`, `StreamDelta`, and `ToolParser`, which
splits a model's text into content and tool calls, whole (`extract_tool_calls`) or as it is generated
(`extract_streaming` per delta, then `finish`). A format only implements `_step`: at the start of the text
not yet decided, how much can be decided now and what it is (content, a `CallStart`, `Arguments`), or
"wait for more". The JSON formats stream their calls with `call_stream`.

Invariants:
- Whole and streamed parsing are one computation: `extract_tool_calls` feeds the text to a fresh parser as
  a single delta. `_step` decides only what no later text can change, so however the text is split, the
  streamed content concatenates to the whole `content`, and the calls are the same, in the same order, with
  the same `arguments` strings.
- Calls stream as vLLM sends them: a call's first `ToolCallDelta` carries its index, id and complete name
  (and the arguments known so far, maybe ""); later ones carry only the index and the next non-empty piece
  of the arguments, as it is generated. The pieces concatenate to the call's `arguments`. A piece is never
  taken back: nothing is sent that later text could change (no closing quote or brace before it is in the
  text, no number before what ends it).
- Content never shows text the parser is still deciding about: a tail that could begin a marker is held
  back until the next delta or `finish()`. A marker that does not open a valid call is ordinary text, and
  so is a call that turns out malformed before its name was sent, verbatim. A call that breaks after its
  name was sent (cut by `max_tokens`, or malformed) stands with the arguments sent so far, which may then
  not be valid JSON (as in vLLM's and OpenAI's streams), and the text from the first character that did not
  fit is read as text again (see `call_stream`). Nothing raises on model output.
- Without a call, `content` is the model's text exactly. With calls, whitespace touching a call is dropped
  (text on both sides of calls stays separated by the whitespace that came before them), and `content` is
  None when nothing else is left.
- `arguments` of a complete call is `json.dumps(<a JSON object>, ensure_ascii=False)`, as vLLM sends them.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from vllm.logger import init_logger

logger = init_logger(__name__)


def make_tool_call_id() -> str:
    """A tool-call id as vLLM makes them: `chatcmpl-tool-<32 hex digits>`."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialised

    @classmethod
    def create(cls, name: str, arguments: str) -> "ToolCall":
        return cls(make_tool_call_id(), name, arguments)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: Optional[str]


@dataclass
class ToolCallDelta:
    """A piece of the `index`-th call of a stream: the first carries its id and name."""

    index: int
    id: Optional[str]
    name: Optional[str]
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    content: Optional[str] = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class CallStart:
    """A format's event: a call begins, with its complete name and the first piece of its arguments."""

    name: str
    arguments: str = ""


@dataclass
class Arguments:
    """A format's event: the next piece of the arguments of the call last started."""

    text: str


# What `_step` returns: None to wait for more text, or (characters used, [content text | CallStart | Arguments]).
Step = Optional[tuple[int, list[Union[str, CallStart, Arguments]]]]


class ToolParser:
    """The base of every format. Streaming state is per request: make one parser per request."""

    name = ""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer  # vLLM's parsers take it; the formats here work on text alone
        self._buf = ""  # text received and not decided yet; `_step` always sees it from its start
        self._at_start = True  # nothing decided yet: `_buf` starts at the model's first character
        self._held_ws = ""  # trailing whitespace of the content, dropped if a call follows
        self._after_call = False  # drop the whitespace that starts the next content
        self._gap = ""  # whitespace before the last calls: it separates the content on their two sides
        self._emitted = False  # some content has been sent
        self._n_calls = 0
        self._failed = False  # `_step` raised: the rest of the output is text
        self._finished = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        parser = type(self)(self.tokenizer)
        deltas = [parser.extract_streaming(model_output), parser.finish()]
        content = "".join(d.content or "" for d in deltas)
        calls: dict[int, ToolCall] = {}
        for piece in (c for d in deltas for c in d.tool_calls):
            if piece.index in calls:
                calls[piece.index].arguments += piece.arguments
            else:
                calls[piece.index] = ToolCall(piece.id or make_tool_call_id(), piece.name or "", piece.arguments)
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        return ExtractedToolCalls(tools_called=True, tool_calls=list(calls.values()), content=content or None)

    def extract_streaming(self, delta_text: str) -> StreamDelta:
        if self._finished:
            return StreamDelta()
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> StreamDelta:
        """Decide whatever is still held back; the end of the output. Later calls return nothing."""
        if self._finished:
            return StreamDelta()
        delta = self._drain(final=True)
        self._finished = True
        return delta

    def _step(self, buf: str, final: bool) -> Step:
        """Decide a prefix of `buf` (the undecided text; `final`: no more will come). Must not return None
        when `final`, and must decide nothing that more text could change."""
        raise NotImplementedError

    def _drain(self, final: bool) -> StreamDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._buf:
            try:
                step = None if self._failed else self._step(self._buf, final)
            except Exception:  # a parser bug must not fail the request: the text stays text
                logger.exception("tool-call parser %r failed; the rest is returned as content", self.name)
                self._failed = True
            if self._failed:
                step = (len(self._buf), [self._buf])
            elif step is None and not final:
                break
            if step is None or (step[0] <= 0 and not step[1]):
                step = (len(self._buf), [self._buf])
            used, events = step
            self._buf = self._buf[used:]
            self._at_start = False
            for event in events:
                if isinstance(event, CallStart):
                    calls.append(self._call(event))
                elif isinstance(event, Arguments):
                    self._arguments(event.text, calls)
                else:
                    self._text(event, content)
        if final and self._held_ws:
            content.append(self._held_ws)
            self._held_ws = ""
        return StreamDelta(content="".join(content) or None, tool_calls=calls)

    def _text(self, text: str, out: list[str]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
            self._held_ws, self._gap = self._gap, ""
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return
        out.append(self._held_ws + body)
        self._held_ws = text[len(body):]
        self._emitted = True

    def _call(self, call: CallStart) -> ToolCallDelta:
        if self._emitted and not self._gap:
            self._gap = self._held_ws
        self._held_ws = ""
        self._after_call = True
        self._n_calls += 1
        return ToolCallDelta(self._n_calls - 1, make_tool_call_id(), call.name, call.arguments)

    def _arguments(self, text: str, calls: list[ToolCallDelta]) -> None:
        """A piece of the last call's arguments: joined to this delta's piece of that call, if any."""
        if not text:
            return
        if calls and calls[-1].index == self._n_calls - 1:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(self._n_calls - 1, None, None, text))


# ---- helpers for the formats -------------------------------------------------------------------------------

_WS = re.compile(r"\s*")


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


def text_until(buf: str, final: bool, markers: tuple[str, ...]) -> Step:
    """Content up to the first of `markers` (`buf` must not start with one); without one, all of `buf`
    but a tail that could begin a marker."""
    found = [i for i in (buf.find(m) for m in markers) if i > 0]
    if found:
        return min(found), [buf[:min(found)]]
    used = len(buf) - (0 if final else held_tail(buf, markers))
    return (used, [buf[:used]]) if used > 0 else None
