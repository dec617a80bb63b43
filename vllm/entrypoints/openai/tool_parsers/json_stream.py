"""Reading JSON as it is generated, and writing it back in `json.dumps` form piece by piece.

What it owns:
- `JsonLexer`: reads one JSON value from a growing text, checking the grammar as it goes, and reports
  what it has decided to a handler: `begin("{" | "[")`, `key_start()`, `key_part(text)`, `key_end()`,
  `string_start()`, `string_part(text)`, `string_end()`, `scalar_start()` (a number or literal begins,
  so a handler can refuse it at once), `scalar(value)`, `end()`. A handler raises `Reject` to stop at the
  event being reported.
- `JsonWriter`: a handler that writes `json.dumps(value, ensure_ascii=False)` of the value it is told
  about, as pieces that concatenate to exactly that string.

Invariants:
- An event is reported only when no later text can change it: a number or a literal when the character
  after it arrives (or the text ends), key and string text as soon as it is decoded (an escape only once
  complete, and a high surrogate once it is known whether a low one follows).
  So the events, and the pieces a writer makes of them, do not depend on how the text was split.
- It reads what `json.loads(text, strict=False)` reads (raw control characters allowed in strings),
  except NaN and infinities, which are not JSON, and a number too large for a float. A repeated key is
  refused by the writer: `json.loads` keeps the last value at the first key's place, which a stream
  cannot show once the first value has been sent.
- `safe()` is the position before which every character has been fully decided; `error` is the
  position of the character (or the start of the token) that cannot continue the value; `end` is the
  position just after the value once it is complete. Positions are in the caller's buffer; `shift`
  follows the caller dropping characters from its start.
"""

from __future__ import annotations

import json
import math
import re
from json.encoder import encode_basestring  # json.dumps of a str with ensure_ascii=False, without the overhead
from typing import Any, Optional

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\]+')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = frozenset("-+0123456789.eE")
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_LITERALS = {"true": True, "false": False, "null": None}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_PARTIAL_U_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")  # what a `\uXXXX` may look like when cut short

# What the lexer expects next.
_VALUE, _FIRST_VALUE, _KEY, _FIRST_KEY, _COLON, _NEXT = range(6)


class Reject(Exception):
    """Raised by a handler: the value cannot go on from the event being reported."""


class JsonLexer:
    def __init__(self, handler: Any, pos: int):
        self.handler = handler
        self.pos = pos  # the next character to read
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.start = pos  # where the event being reported starts (what `Reject` points at)
        self.end: Optional[int] = None
        self.error: Optional[int] = None
        self._expect = _VALUE
        self._string: Optional[str] = None  # "key" or "value" while inside a string
        self._token: Optional[int] = None  # the start of the number or literal being read
        self._token_chars: frozenset[str] = frozenset()

    def safe(self) -> int:
        return self.pos if self._token is None else self._token

    def shift(self, n: int) -> None:
        self.pos -= n
        self.start -= n
        if self._token is not None:
            self._token -= n
        if self.end is not None:
            self.end -= n

    def run(self, buf: str, final: bool) -> None:
        """Read `buf` on from `pos` (`final`: nothing follows it) until the value ends, fails, or the text
        runs out."""
        try:
            self._run(buf, final)
        except Reject:
            self.error = self.start

    def _fail(self, at: int) -> None:
        self.error = min(at, self.safe())  # a token cut short is not part of the value

    def _run(self, buf: str, final: bool) -> None:
        size = len(buf)
        while self.end is None and self.error is None:
            if self._string is not None:
                if not self._read_string(buf, final):
                    return
                continue
            if self._token is not None:
                pos = self.pos
                while pos < size and buf[pos] in self._token_chars:
                    pos += 1
                self.pos = pos
                if pos == size and not final:
                    return
                self._scalar(buf[self._token:pos])
                continue
            if self.pos >= size:
                if final:
                    self._fail(size)
                return
            char = buf[self.pos]
            if char in _WS:
                self.pos += 1
            elif self._expect in (_VALUE, _FIRST_VALUE):
                self._value(char)
            elif self._expect in (_KEY, _FIRST_KEY):
                if char == '"':
                    self.start, self._string = self.pos, "key"
                    self.handler.key_start()
                    self.pos += 1
                elif char == "}" and self._expect == _FIRST_KEY:
                    self._close()
                else:
                    self._fail(self.pos)
            elif self._expect == _COLON:
                if char != ":":
                    return self._fail(self.pos)
                self._expect = _VALUE
                self.pos += 1
            elif char == ",":  # _NEXT
                self._expect = _KEY if self.stack[-1] == "{" else _VALUE
                self.pos += 1
            elif char == ("}" if self.stack[-1] == "{" else "]"):
                self._close()
            else:
                self._fail(self.pos)

    def _value(self, char: str) -> None:
        self.start = self.pos
        if char in "{[":
            self.handler.begin(char)
            self.stack.append(char)
            self._expect = _FIRST_KEY if char == "{" else _FIRST_VALUE
            self.pos += 1
        elif char == "]" and self._expect == _FIRST_VALUE:
            self._close()
        elif char == '"':
            self.handler.string_start()
            self._string = "value"
            self.pos += 1
        elif char in "-0123456789":
            self.handler.scalar_start()
            self._token, self._token_chars = self.pos, _NUMBER_CHARS
        elif char in "tfn":
            self.handler.scalar_start()
            self._token, self._token_chars = self.pos, _LETTERS
        else:
            self._fail(self.pos)

    def _scalar(self, text: str) -> None:
        self.start, self._token = self._token, None
        if text in _LITERALS:
            value = _LITERALS[text]
        elif _NUMBER.fullmatch(text):
            try:
                value = json.loads(text)
            except ValueError:  # an integer too long to convert
                return self._fail(self.start)
            if isinstance(value, float) and not math.isfinite(value):
                return self._fail(self.start)  # 1e999: json.dumps would write Infinity
        else:
            return self._fail(self.start)
        self.handler.scalar(value)
        self._after_value()

    def _close(self) -> None:
        self.start = self.pos
        self.handler.end()
        self.stack.pop()
        self.pos += 1
        self._after_value()

    def _after_value(self) -> None:
        if self.stack:
            self._expect = _NEXT
        else:
            self.end = self.pos

    def _read_string(self, buf: str, final: bool) -> bool:
        """Read string text; False when the text runs out (or the string is broken)."""
        size = len(buf)
        while True:
            run = _STRING_RUN.match(buf, self.pos)
            if run:
                self._part(run.group())
                self.pos = run.end()
            if self.pos >= size:
                if final:
                    self._fail(size)
                return False
            if buf[self.pos] == '"':
                self.pos += 1
                self._end_string()
                return True
            decoded, used = _escape(buf, self.pos, final)
            if used is None:  # cut short: wait at the backslash
                if final:
                    self._fail(self.pos)
                return False
            if not used:
                self._fail(self.pos)
                return False
            self._part(decoded)
            self.pos += used

    def _part(self, text: str) -> None:
        if self._string == "key":
            self.handler.key_part(text)
        else:
            self.handler.string_part(text)

    def _end_string(self) -> None:
        if self._string == "key":
            self._string, self.start = None, self.pos  # a refused key stops after itself: it has been sent
            self.handler.key_end()
            self._expect = _COLON
        else:
            self._string = None
            self.handler.string_end()
            self._after_value()


def _escape(buf: str, pos: int, final: bool) -> tuple[str, Optional[int]]:
    """The character the escape at `pos` stands for and its length; length None: cut short, 0: invalid.
    A surrogate pair is one character, as `json.loads` reads it."""
    if pos + 1 >= len(buf):
        return "", None
    kind = buf[pos + 1]
    if kind in _ESCAPES:
        return _ESCAPES[kind], 2
    if kind != "u":
        return "", 0
    digits = buf[pos + 2:pos + 6]
    if not _HEX4.fullmatch(digits):
        return "", None if len(digits) < 4 and _PARTIAL_U_ESCAPE.fullmatch(buf[pos:pos + 6]) else 0
    code = int(digits, 16)
    if not 0xD800 <= code <= 0xDBFF:
        return chr(code), 6
    low = buf[pos + 6:pos + 12]
    if len(low) < 6 and not final and (not low or _PARTIAL_U_ESCAPE.fullmatch(low)):
        return "", None  # a low surrogate may follow
    if low.startswith("\\u") and _HEX4.fullmatch(low[2:6]) and 0xDC00 <= int(low[2:6], 16) <= 0xDFFF:
        return chr(0x10000 + ((code - 0xD800) << 10 | (int(low[2:6], 16) - 0xDC00))), 12
    return chr(code), 6


class JsonWriter:
    """A lexer handler writing `json.dumps(value, ensure_ascii=False)` of the value into `out`, in pieces."""

    def __init__(self, out: list[str]):
        self.out = out
        self._open: list[Optional[set[str]]] = []  # per open container: its keys (None for an array)
        self._first: list[bool] = []

    def _item(self) -> None:
        if self._open and self._open[-1] is None:  # a value in an array
            if not self._first[-1]:
                self.out.append(", ")
            self._first[-1] = False

    def begin(self, kind: str) -> None:
        self._item()
        self.out.append(kind)
        self._open.append(set() if kind == "{" else None)
        self._first.append(True)

    def key_start(self) -> None:
        self.out.append('"' if self._first[-1] else ', "')
        self._first[-1] = False
        self._key: list[str] = []

    def key_part(self, text: str) -> None:
        self._key.append(text)
        self.string_part(text)

    def key_end(self) -> None:
        name, keys = "".join(self._key), self._open[-1]
        self.out.append('"')
        if name in keys:
            raise Reject
        keys.add(name)
        self.out.append(": ")

    def key(self, name: str) -> None:
        self.key_start()
        self.key_part(name)
        self.key_end()

    def string_start(self) -> None:
        self._item()
        self.out.append('"')

    def string_part(self, text: str) -> None:
        self.out.append(encode_basestring(text)[1:-1])

    def string_end(self) -> None:
        self.out.append('"')

    def scalar_start(self) -> None:
        pass

    def scalar(self, value: Any) -> None:
        self._item()
        self.out.append(json.dumps(value))

    def end(self) -> None:
        self.out.append("}" if self._open.pop() is not None else "]")
        self._first.pop()
