"""`hermes`: Hermes-style calls, as Qwen 2.5/3 (and Granite 4) write them.

What it owns: the tagged-JSON format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated
for several calls, with text before (and, leniently, between or after) them; `granite` reuses it.

Invariants (on top of `base`'s and `call_stream`'s, which streams the calls):
- A call is a start marker, optional whitespace, then one JSON value: a call object, or a non-empty array
  of them. `arguments` may be missing or null (`{}`), or a string holding a JSON object (read back).
  `</tool_call>` after it is consumed; when it is missing the call still counts.
- A marker whose first call breaks before its name is sent is text, and what follows the marker is parsed
  as text again, so the calls after a malformed one are still found. A call that breaks later stands, and
  the text from where it broke is parsed again (a `</tool_call>` right there is dropped).
  `</tool_call>` inside a JSON string does not end a call.
"""

from __future__ import annotations

from typing import Optional

from vllm.entrypoints.openai.tool_parsers.base import Step, ToolParser, skip_ws, text_until
from vllm.entrypoints.openai.tool_parsers.call_stream import MORE, NOT_A_CALL, WAIT, CallStream


class HermesToolParser(ToolParser):
    name = "hermes"
    START: tuple[str, ...] = ("<tool_call>",)
    END = "</tool_call>"
    # A JSON array opening the output is a call list too (Granite 3.0 once its `<|tool_call|>` special
    # token has been skipped in detokenisation).
    BARE_ARRAY = False

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._calls: Optional[CallStream] = None  # the JSON of the calls being received
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
        if self._calls is None:
            start = self._call_start(buf, final)
            if start is None:
                return None
            if start < 0:
                return text_until(buf, final, self.START)
            if start == len(buf) or buf[start] not in "{[":
                return self._not_a_call(buf)
            self._calls = CallStream(start)
        outcome, pos, events = self._calls.advance(buf, final)
        if outcome == WAIT:
            return None
        if outcome == NOT_A_CALL:
            return self._not_a_call(buf)
        if outcome == MORE:
            self._calls.shift(pos)
            return (pos, events) if pos or events else None
        self._calls = None  # DONE, or BROKEN: what follows is read as text (a closing tag is dropped)
        self._closing = True
        return (pos, events) if pos or events else self._step(buf, final)

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
        self._calls = None
        return self._opener, [buf[:self._opener]]
