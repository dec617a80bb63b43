"""`pythonic` (also `llama4_pythonic`): calls written as a Python list, as Llama 3.2/4 and ToolACE do.

What it owns: `[get_weather(city="Paris", days=3), get_time()]`, read with `ast` (never evaluated), and
Llama 4's wrapping of it in `<|python_start|>` ... `<|python_end|>` (present when special tokens are kept).

Invariants (on top of `base`'s):
- The list opens the output (after whitespace), or follows `<|python_start|>` anywhere (text before it is
  content). Text after the list is content; a `<|python_end|>` right after it is dropped.
- Every element must be `name(keyword=literal, ...)`: a plain name, keyword arguments only, and values that
  are literals: strings, numbers (signed), True/False/None (and JSON's true/false/null), lists, tuples and
  dicts with string keys, nested. Anything else (positional arguments, variables, calls, f-strings, an
  empty list) makes the whole list text, as `[1] See the docs.` is.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Optional

from vllm.entrypoints.openai.tool_parsers.base import (
    IncrementalSpan,
    ParsedCall,
    Step,
    ToolParser,
    skip_ws,
    text_until,
)

START, END = "<|python_start|>", "<|python_end|>"
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
_CLOSE = {")": "(", "]": "[", "}": "{"}


class _NotACall(Exception):
    pass


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._span: Optional[_PythonSpan] = None  # the list being received
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
        if self._span is None:
            start = self._list_start(buf, final)
            if start is None:
                return None
            if start < 0:
                if buf.startswith(START):  # a marker that opens no list
                    return len(START), [START]
                return text_until(buf, final, (START,))
            self._span = _PythonSpan(start)
        end = self._span.scan(buf)
        if end is None and not final:
            return None
        calls = _calls_from_python(buf[self._span.start:end]) if end not in (None, _PythonSpan.BAD) else None
        self._span = None
        if calls is None:
            return self._opener, [buf[:self._opener]]
        self._closing = True
        return end, calls

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


_PLAIN = re.compile(r"[^\\'\"]*")


class _PythonSpan(IncrementalSpan):
    """The Python list starting at `start`: brackets outside string literals (single, double,
    triple-quoted, with escapes). `BAD` (-1) once the text cannot be a call list."""

    def __init__(self, start: int):
        super().__init__(start)
        self._quote = ""  # the quote that closes the string being read
        self._first = True  # the list's first element must start with a name

    def _advance(self, text: str) -> Optional[int]:
        pos, size = self._pos, len(text)
        while pos < size:
            if self._quote:
                pos = _PLAIN.match(text, pos).end()
                if pos >= size:
                    break
                if text[pos] == "\\":
                    if pos + 1 >= size:
                        break
                    pos += 2
                    continue
                if text.startswith(self._quote, pos):
                    pos += len(self._quote)
                    self._quote = ""
                    continue
                if len(self._quote) == 3 and self._quote.startswith(text[pos:]):
                    break  # maybe the closing triple quote, cut short
                pos += 1
                continue
            char = text[pos]
            if self._first and self._stack and not char.isspace():
                if not char.isidentifier():
                    return self.BAD
                self._first = False
            if char in "'\"":
                if text.startswith(char * 3, pos):
                    self._quote = char * 3
                elif (char * 3).startswith(text[pos:]):
                    break  # `''` at the end: an empty string or the start of `'''`
                else:
                    self._quote = char
                pos += len(self._quote)
                continue
            if char in "([{":
                self._stack.append(char)
            elif char in _CLOSE:
                if not self._stack or self._stack.pop() != _CLOSE[char]:
                    return self.BAD
                if not self._stack:
                    return pos + 1
            pos += 1
        self._pos = pos
        return None


def _calls_from_python(source: str) -> Optional[list[ParsedCall]]:
    try:
        tree = ast.parse(source, mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        return [_call(element) for element in tree.body.elts]
    except (SyntaxError, ValueError, RecursionError, MemoryError, _NotACall):
        return None


def _call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotACall
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise _NotACall
        arguments[keyword.arg] = _literal(keyword.value)
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, bool, int, float)):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, ast.Name) and node.id in _NAMES:
        value = _NAMES[node.id]
    elif isinstance(node, (ast.List, ast.Tuple)):
        value = [_literal(element) for element in node.elts]
    elif isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                            for k in node.keys):
        value = {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    else:
        raise _NotACall
    if isinstance(value, float) and not math.isfinite(value):
        raise _NotACall
    return value
