"""`hermes`: Hermes-style calls, as Qwen 2.5/3 (and Granite 4) write them.

What it owns: the tagged-JSON format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated
for several calls, with text before (and, leniently, between or after) them; `granite` reuses it.

Invariants (on top of `base`'s):
- A call is a start marker, optional whitespace, then one JSON value: a call object, or a non-empty array
  of them (all of which must be calls). `arguments` may be missing or null (`{}`), or a string holding a
  JSON object (read back). `</tool_call>` after it is consumed; when it is missing the call still counts.
- A marker not followed by a valid call is text, and what follows it is parsed as text again, so the
  calls after a malformed one are still found. `</tool_call>` inside a JSON string does not end a call.
"""

from __future__ import annotations

from typing import Optional

from vllm.entrypoints.openai.tool_parsers.base import (
    JsonSpan,
    Step,
    ToolParser,
    calls_from_json,
    load_json,
    skip_ws,
    text_until,
)


class HermesToolParser(ToolParser):
    name = "hermes"
    START: tuple[str, ...] = ("<tool_call>",)
    END = "</tool_call>"
    # A JSON array opening the output is a call list too (Granite 3.0 once its `<|tool_call|>` special
    # token has been skipped in detokenisation).
    BARE_ARRAY = False

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._span: Optional[JsonSpan] = None  # the JSON of the call being received
        self._opener = 0  # how much of `_buf` becomes text if that call turns out invalid
        self._closing = False  # a call was just sent: its closing tag may follow

    def _step(self, buf: str, final: bool) -> Step:
        if self._closing:
            pos = skip_ws(buf, 0)
            if buf.startswith(self.END, pos):
                self._closing = False
                return pos + len(self.END), []
            if not final and self.END.startswith(buf[pos:]):
                return None
            self._closing = False
        if self._span is None:
            start = self._call_start(buf, final)
            if start is None:
                return None
            if start < 0:
                return text_until(buf, final, self.START)
            if start == len(buf) or buf[start] not in "{[":
                return self._not_a_call(buf)
            self._span = JsonSpan(start)
        end = self._span.scan(buf)
        if end is None:
            return self._not_a_call(buf) if final else None
        calls = calls_from_json(load_json(buf[self._span.start:end])) if end != JsonSpan.BAD else None
        if calls is None:
            return self._not_a_call(buf)
        self._span = None
        self._closing = True
        return end, calls

    def _call_start(self, buf: str, final: bool) -> Optional[int]:
        """Where the JSON of a call would start if `buf` opens one (len(buf) when the text ends first),
        -1 when it does not, None when that depends on text still to come. Sets `_opener`."""
        if self.BARE_ARRAY and self._at_start:
            first = skip_ws(buf, 0)
            if first == len(buf) and not final:
                return None
            if buf.startswith("[", first):
                self._opener = first + 1
                return first
        opener = next((m for m in self.START if buf.startswith(m)), None)
        if opener is None:
            return -1
        self._opener = len(opener)
        pos = skip_ws(buf, len(opener))
        while True:  # `<|tool_call|><tool_call>[...]`: repeated markers open one call
            rest = buf[pos:]
            again = next((m for m in self.START if rest.startswith(m)), None)
            if again is not None:
                pos = skip_ws(buf, pos + len(again))
            elif not final and (not rest or any(m.startswith(rest) for m in self.START)):
                return None
            else:
                return pos

    def _not_a_call(self, buf: str) -> Step:
        self._span = None
        return self._opener, [buf[:self._opener]]
