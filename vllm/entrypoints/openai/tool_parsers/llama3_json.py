"""`llama3_json` (also `llama4_json`): Llama 3.x/4 JSON tool calls.

What it owns: the format of Llama's JSON tool-calling prompts: the output is one or more call objects
`{"name": ..., "parameters": {...}}` (or `"arguments"`) separated by `;`, optionally after the
`<|python_tag|>` token (present when special tokens are kept).

Invariants (on top of `base`'s):
- Calls open the output (after whitespace), or follow `<|python_tag|>` anywhere (the text before it is
  content). A `{` elsewhere is text: a JSON object in the middle of an answer is never a call.
- A call object needs a non-empty string `name` and a `parameters` or `arguments` key, so an answer that is
  JSON (`{"name": "Ada", "age": 36}`) stays content. After a call, `; {...}` continues the list; a
  trailing `;` is dropped; anything else is content again.
- An object that breaks before its call starts (its name is complete and its arguments have begun) is
  text from its `{` on; one that breaks later stands as a call (see `call_stream`), and the rest is text.
"""

from __future__ import annotations

from typing import Optional

from vllm.entrypoints.openai.tool_parsers.base import Step, ToolParser, skip_ws, text_until
from vllm.entrypoints.openai.tool_parsers.call_stream import DONE, MORE, NOT_A_CALL, WAIT, CallStream

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._object: Optional[CallStream] = None  # the object being received
        self._opener = 0  # how much of `_buf` becomes text if that object is not a call
        self._in_list = False  # just after a call: `;` may bring the next one

    def _step(self, buf: str, final: bool) -> Step:
        if self._object is None:
            if self._in_list:
                return self._next_in_list(buf, final)
            start = self._call_start(buf, final)
            if start is None:
                return None
            if start < 0:
                if buf.startswith(PYTHON_TAG):  # a tag that opens no call
                    return len(PYTHON_TAG), [PYTHON_TAG]
                return text_until(buf, final, (PYTHON_TAG,))
            self._object = CallStream(start, need_arguments=True, arrays=False)
        outcome, pos, events = self._object.advance(buf, final)
        if outcome == WAIT:
            return None
        if outcome == MORE:
            self._object.shift(pos)
            return (pos, events) if pos or events else None
        self._object = None
        self._in_list = outcome == DONE  # after a broken call, the rest is text
        if outcome == NOT_A_CALL:
            return self._opener, [buf[:self._opener]]
        return (pos, events) if pos or events else self._step(buf, final)

    def _call_start(self, buf: str, final: bool) -> Optional[int]:
        """Where a call object starts if `buf` opens one, -1 when it does not, None when that depends on
        text still to come. Sets `_opener`."""
        pos = skip_ws(buf, 0)
        if self._at_start:
            if pos == len(buf) and not final:
                return None
            if buf.startswith("{", pos):
                self._opener = pos + 1
                return pos
        if not buf.startswith(PYTHON_TAG):
            return -1
        pos = skip_ws(buf, len(PYTHON_TAG))
        if pos == len(buf) and not final:
            return None
        self._opener = len(PYTHON_TAG)
        return pos if buf.startswith("{", pos) else -1

    def _next_in_list(self, buf: str, final: bool) -> Step:
        """Just after a call: `;` and the next call, or the end of the list."""
        pos = skip_ws(buf, 0)
        if buf.startswith(";", pos):
            start = skip_ws(buf, pos + 1)
            if start == len(buf):
                return (start, []) if final else None  # a trailing `;` is dropped
            if buf[start] == "{":
                self._object, self._opener = CallStream(start, need_arguments=True, arrays=False), start
                return self._step(buf, final)
            self._in_list = False
            return pos + 1, [buf[:pos + 1]]
        if pos == len(buf) and not final:
            return None
        self._in_list = False
        return (pos, [buf[:pos]]) if pos else self._step(buf, final)
