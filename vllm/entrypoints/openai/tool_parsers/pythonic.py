"""`pythonic` (also `llama4_pythonic`): calls written as a Python list, as Llama 3.2/4 and ToolACE do.

What it owns: where `[get_weather(city="Paris", days=3), get_time()]` starts, and Llama 4's wrapping of it
in `<|python_start|>` ... `<|python_end|>` (present when special tokens are kept); `python_stream` reads
the list (never evaluated) and `call_stream` streams its calls.

Invariants (on top of `base`'s and `call_stream`'s):
- The list opens the output (after whitespace), or follows `<|python_start|>` anywhere (text before it is
  content). Text after the list is content; a `<|python_end|>` right after it is dropped.
- Every element must be `name(keyword=literal, ...)` (see `python_stream`). A list whose first call never
  starts (positional arguments, a variable, an empty list, `[1] See the docs.`) is text; once a call has
  started, the first thing that does not fit ends the calls, and the rest is text again.
"""

from __future__ import annotations

from typing import Optional

from vllm.entrypoints.openai.tool_parsers.base import Step, ToolParser, skip_ws, text_until
from vllm.entrypoints.openai.tool_parsers.call_stream import MORE, NOT_A_CALL, WAIT, CallStream
from vllm.entrypoints.openai.tool_parsers.python_stream import PythonCallLexer

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._calls: Optional[CallStream] = None  # the list being received
        self._opener = 0  # how much of `_buf` becomes text if the list is not a call list
        self._closing = False  # calls were just sent: `<|python_end|>` may follow

    def _step(self, buf: str, final: bool) -> Step:
        if self._closing:
            pos = skip_ws(buf, 0)
            if buf.startswith(END, pos):
                self._closing = False
                return pos + len(END), []
            if not final and END.startswith(buf[pos:]):
                return None
            self._closing = False
        if self._calls is None:
            start = self._list_start(buf, final)
            if start is None:
                return None
            if start < 0:
                if buf.startswith(START):  # a marker that opens no list
                    return len(START), [START]
                return text_until(buf, final, (START,))
            self._calls = CallStream(start, need_arguments=True, objects=False, lexer=PythonCallLexer)
        outcome, pos, events = self._calls.advance(buf, final)
        if outcome == WAIT:
            return None
        if outcome == NOT_A_CALL:
            self._calls = None
            return self._opener, [buf[:self._opener]]
        if outcome == MORE:
            self._calls.shift(pos)
            return (pos, events) if pos or events else None
        self._calls = None  # DONE, or BROKEN: what follows is text (a `<|python_end|>` is dropped)
        self._closing = True
        return (pos, events) if pos or events else self._step(buf, final)

    def _list_start(self, buf: str, final: bool) -> Optional[int]:
        """Where the list starts if `buf` opens one, -1 when it does not, None when that depends on text
        still to come. Sets `_opener`."""
        pos = skip_ws(buf, 0)
        if self._at_start:
            if pos == len(buf) and not final:
                return None
            if buf.startswith("[", pos):
                self._opener = pos + 1
                return pos
        if not buf.startswith(START):
            return -1
        pos = skip_ws(buf, len(START))
        if pos == len(buf) and not final:
            return None
        self._opener = len(START)
        return pos if buf.startswith("[", pos) else -1
