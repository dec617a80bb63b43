"""Streaming the tool calls of a JSON call object, or of an array of them, as vLLM sends them.

What it owns: `CallStream`, which reads `{"name": ..., "arguments" | "parameters": {...}}` (or a non-empty
array of such objects) from where a format found it, and turns it into stream events: `CallStart(name,
first arguments)` once the call's name is known, then `Arguments` pieces, which concatenate to
`json.dumps(arguments, ensure_ascii=False)`. The formats (`hermes`, `granite`, `llama3_json`,
`tool_choice="required"`) only find where calls start and what follows them.

Invariants:
- A call starts (its name is sent) once its name is complete and, with `need_arguments`, its arguments
  have begun: `{`, a string holding a JSON object (sent whole when it closes), or `null` (`{}`). Missing
  arguments are `{}`, sent when the object closes. Other keys are read and ignored; a repeated `name`,
  `arguments` or `parameters` key, like a repeated key inside the arguments, is malformed.
- Until the first call has started nothing is consumed, so a malformed first call is `NOT_A_CALL` and the
  format keeps its text as content. Once a call has started it cannot be taken back: if the text then
  stops being a valid call (or ends), the result is `BROKEN` at the first character that does not fit (a
  later array item that never started a call breaks at its start). The calls sent stand, the started one
  with the arguments sent so far (which may not be valid JSON: e.g. output cut by `max_tokens`), and the
  format reads the text from that point as text again.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from vllm.entrypoints.openai.tool_parsers.base import Arguments, CallStart
from vllm.entrypoints.openai.tool_parsers.json_stream import JsonLexer, JsonWriter, Reject

# `advance` outcomes
WAIT, MORE, DONE, BROKEN, NOT_A_CALL = "wait", "more", "done", "broken", "not_a_call"
_ARGUMENT_KEYS = ("arguments", "parameters")
_LENIENT = json.JSONDecoder(strict=False)  # models write raw newlines and tabs inside strings


class _Item:
    """The call object being read."""

    def __init__(self, start: int):
        self.start = start
        self.pending: list[str] = []  # argument pieces read before the call starts (arguments before name)
        self.out: list[Any] = self.pending  # where argument pieces go: then the stream's events
        self.name: Optional[str] = None
        self.name_parts: Optional[list[str]] = None
        self.field: Optional[str] = None  # the call key whose value is being read: "name", "arguments"
        self.seen: set[str] = set()
        self.writer: Optional[JsonWriter] = None  # the arguments object, streamed
        self.text: Optional[list[str]] = None  # arguments written as a JSON string, read whole
        self.text_start = 0
        self.arguments = False  # the arguments value has begun (or is complete)
        self.started = False


class CallStream:
    """Reads the call object (or array of them, as allowed) starting at `start` in the caller's buffer."""

    def __init__(self, start: int, need_arguments: bool = False, objects: bool = True, arrays: bool = True,
                 lexer: type = JsonLexer):
        self._lexer = lexer(self, start)
        self._need_arguments = need_arguments
        self._objects, self._arrays = objects, arrays
        self._base = 0  # the depth of the call objects: 1 inside an array
        self._item: Optional[_Item] = None
        self._key: list[str] = []  # the call key being read
        self._calls = 0
        self._events: list[Any] = []

    def advance(self, buf: str, final: bool) -> tuple[str, int, list[Any]]:
        """Read on in `buf`: (outcome, position, events). MORE: the text before `position` is decided and
        may be dropped (call `shift`); DONE: the value ends at `position`; BROKEN: the calls end at
        `position`, the rest is text again. The events are `CallStart` and `Arguments`."""
        lexer = self._lexer
        lexer.run(buf, final)
        events = _merged(self._events)
        self._events.clear()  # argument writers keep appending to this list
        item = self._item
        if lexer.error is not None:
            if item is not None and item.started:  # arguments held as a string are text again
                return BROKEN, lexer.error if item.text is None else min(lexer.error, item.text_start), events
            if not self._calls:
                return NOT_A_CALL, lexer.error, []
            return BROKEN, item.start if item is not None else lexer.error, events
        if lexer.end is not None:
            return DONE, lexer.end, events
        if not self._calls:
            return WAIT, 0, []
        safe = lexer.safe()
        if item is not None and not item.started:
            safe = min(safe, item.start)
        elif item is not None and item.text is not None:
            safe = min(safe, item.text_start)
        return MORE, safe, events

    def shift(self, n: int) -> None:
        self._lexer.shift(n)
        if self._item is not None:
            self._item.start -= n
            self._item.text_start -= n

    # ---- lexer events ----------------------------------------------------------------------------------

    def _depth(self) -> int:
        return len(self._lexer.stack)

    def begin(self, kind: str) -> None:
        depth, item = self._depth(), self._item
        if depth == 0 and kind == "[" and self._arrays:
            self._base = 1
        elif depth == self._base and kind == "{" and (self._base or self._objects):
            self._item = _Item(self._lexer.start)
        elif item is None or depth == self._base:
            raise Reject
        elif item.field == "arguments":
            if depth == self._base + 1:
                if kind != "{":
                    raise Reject
                item.writer = JsonWriter(item.out)
                item.arguments = True
            item.writer.begin(kind)
            self._maybe_start()
        elif item.field == "name":
            raise Reject

    def key_start(self) -> None:
        if self._depth() == self._base + 1:
            self._key = []
        elif self._item.field == "arguments":
            self._item.writer.key_start()

    def key_part(self, text: str) -> None:
        if self._depth() == self._base + 1:
            self._key.append(text)
        elif self._item.field == "arguments":
            self._item.writer.key_part(text)

    def key_end(self) -> None:
        if self._depth() == self._base + 1:
            self.key("".join(self._key))
        elif self._item.field == "arguments":
            self._item.writer.key_end()

    def key(self, name: str) -> None:
        item = self._item
        if self._depth() == self._base + 1:
            field = "name" if name == "name" else "arguments" if name in _ARGUMENT_KEYS else None
            if field in item.seen:
                raise Reject
            if field:
                item.seen.add(field)
            item.field = field
        elif item.field == "arguments":
            item.writer.key(name)

    def string_start(self) -> None:
        item, depth = self._item, self._depth()
        if item is None or depth == self._base:
            raise Reject
        if depth == self._base + 1 and item.field == "name":
            item.name_parts = []
        elif depth == self._base + 1 and item.field == "arguments":
            item.text, item.text_start, item.arguments = [], self._lexer.start, True
            self._maybe_start()
        elif item.field == "arguments":
            item.writer.string_start()

    def string_part(self, text: str) -> None:
        item = self._item
        if len(self._lexer.stack) > self._base + 1:  # inside the arguments (or an ignored value)
            if item.field == "arguments":
                item.writer.string_part(text)
        elif item.field == "name":
            item.name_parts.append(text)
        elif item.field == "arguments":
            item.text.append(text)

    def string_end(self) -> None:
        item = self._item
        if self._depth() == self._base + 1 and item.field == "name":
            item.name = "".join(item.name_parts)
            if not item.name:
                raise Reject
            self._maybe_start()
        elif self._depth() == self._base + 1 and item.field == "arguments":
            item.out.append(_read_back("".join(item.text)))
            item.text = None
        elif item.field == "arguments":
            item.writer.string_end()

    def scalar_start(self) -> None:
        item, depth = self._item, self._depth()
        if item is None or depth == self._base or (depth == self._base + 1 and item.field == "name"):
            raise Reject  # a number where a call or a name should be

    def scalar(self, value: Any) -> None:
        item, depth = self._item, self._depth()
        if depth == self._base + 1 and item.field == "arguments":
            if value is not None:
                raise Reject
            item.out.append("{}")
            item.arguments = True
            self._maybe_start()
        elif item.field == "arguments":
            item.writer.scalar(value)

    def end(self) -> None:
        item, depth = self._item, self._depth() - 1  # the depth of the container closing
        if item is None:  # the array: it must have held a call
            if not self._calls:
                raise Reject
        elif depth == self._base:
            if not item.started:
                raise Reject  # no name (or, with `need_arguments`, no arguments): not a call
            if not item.arguments:
                item.out.append("{}")
            self._item = None
        elif item.field == "arguments":
            item.writer.end()

    def _maybe_start(self) -> None:
        item = self._item
        if item.started or item.name is None or (self._need_arguments and not item.arguments):
            return
        item.started = True
        self._calls += 1
        self._events.append(CallStart(item.name, "".join(item.pending)))
        item.out = self._events
        if item.writer is not None:
            item.writer.out = self._events


def _read_back(text: str) -> str:
    """Arguments the model wrote as a JSON string: the object it holds, in `json.dumps` form."""
    try:
        value = _LENIENT.decode(text)
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # not JSON, or NaN / Infinity inside
        pass
    raise Reject


def _merged(events: list[Any]) -> list[Any]:
    """`CallStart`s, and the argument pieces between them joined into one `Arguments` each."""
    merged: list[Any] = []
    for event in events:
        if isinstance(event, CallStart):
            merged.append(event)
        elif merged and isinstance(merged[-1], Arguments):
            merged[-1].text += event
        else:
            merged.append(Arguments(event))
    return merged
