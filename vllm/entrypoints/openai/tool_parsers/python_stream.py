"""Reading a Python list of calls as it is generated, for `pythonic`: `[get_weather(city="Paris"), now()]`.

What it owns: `PythonCallLexer`, a drop-in for `json_stream.JsonLexer` under `call_stream.CallStream`: it
reads the list and reports it as the JSON `[{"name": ..., "arguments": {...}}, ...]` would be reported, so
the calls stream exactly like the JSON formats' (and nothing is ever evaluated).

Invariants:
- What it reads is what `ast` reads as a list of `name(keyword=literal, ...)`: a plain name, keyword
  arguments only, literal values: strings (quotes, triple quotes, `r`/`u` prefixes, escapes, adjacent
  literals joined), numbers (signed, `_`, hex/octal/binary), True/False/None (and JSON's true/false/null),
  lists, tuples (as JSON arrays; `(x)` is just x) and dicts with string keys. Anything else (positional
  arguments, names, calls, f-strings, bytes, comments, infinite floats) cannot continue the list.
- An event is reported only when no later text can change it: a call once its first argument value
  begins (or it closes), so `[1] See the docs.` and `[f("Paris")]` fail before any call starts; a string
  ends once what follows shows no adjacent literal; a parenthesis is held until a comma or its closing
  shows whether it is a tuple (and on failure, text from an undecided parenthesis on is not part of a call).
"""

from __future__ import annotations

import keyword
import re
from typing import Any, Optional

from vllm.entrypoints.openai.tool_parsers.json_stream import Reject
from vllm.entrypoints.openai.tool_parsers.python_literals import escape, is_radix, number

_WS = " \t\r\n"
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
_CLOSE = {"[": "]", "(": ")", "{": "}"}
_PLAIN = {q: re.compile(r"[^\\%s\n]*" % q if len(q) == 1 else r"[^\\%s]*" % q[0])  # a literal's plain text
          for q in ("'", '"', "'" * 3, '"' * 3)}

# What comes next: in the call list, then inside a value.
(_LIST, _CALL_OR_END, _OPEN_PAREN, _KEYWORD_OR_CLOSE, _EQUALS, _ARG_NEXT, _CALL_NEXT,
 _VALUE, _VALUE_OR_CLOSE, _NEXT, _KEY_OR_CLOSE, _COLON) = range(12)


class _Wait(Exception):
    """More text is needed before anything can be decided: state is as it was before the attempt."""


class _Frame:
    """An open list, tuple or dict; an undecided parenthesis keeps its events until it is decided."""

    def __init__(self, kind: str, start: int):
        self.kind, self.start = kind, start
        self.items = 0
        self.capture: Optional[list[tuple[str, tuple]]] = [] if kind == "(" else None


class PythonCallLexer:
    def __init__(self, handler: Any, pos: int):
        self.handler = handler
        self.pos = pos
        self.stack: list[str] = []  # the containers reported open, as `JsonLexer.stack`
        self.start = pos
        self.end: Optional[int] = None
        self.error: Optional[int] = None
        self._expect = _LIST
        self._open: list[_Frame] = []  # the Python containers open inside an argument value
        self._token: Optional[int] = None  # the start of the name or number being read
        self._token_kind = ""
        self._quote = ""  # the quote that closes the string literal being read
        self._raw = False
        self._string: Optional[str] = None  # "key" or "value" while a string (maybe of adjacent literals) lasts
        self._after_literal = False  # a literal just closed: an adjacent one may continue the string
        self._key: list[str] = []
        self._key_start = 0
        self._call: Optional[tuple[str, int]] = None  # the call whose start is not reported yet: name, start
        self._keyword: Optional[tuple[str, int]] = None  # the keyword whose value is not reported yet

    def safe(self) -> int:
        marks = [self.pos]
        if self._token is not None:
            marks.append(self._token)
        if self._string == "key":
            marks.append(self._key_start)
        if self._call is not None:
            marks.append(self._call[1])
        if self._keyword is not None:
            marks.append(self._keyword[1])
        marks.extend(f.start for f in self._open if f.capture is not None)
        return min(marks)

    def shift(self, n: int) -> None:
        self.pos -= n
        self.start -= n
        self._key_start -= n
        if self._token is not None:
            self._token -= n
        if self.end is not None:
            self.end -= n
        if self._call is not None:
            self._call = (self._call[0], self._call[1] - n)
        if self._keyword is not None:
            self._keyword = (self._keyword[0], self._keyword[1] - n)
        for frame in self._open:
            frame.start -= n

    def run(self, buf: str, final: bool) -> None:
        try:
            self._run(buf, final)
        except _Wait:
            pass
        except Reject:
            self._fail(self.start)

    def _fail(self, at: int) -> None:
        """Stop at `at`, or earlier where text read so far is not part of a reported call."""
        self.error = min(at, self.safe())

    # ---- reading ---------------------------------------------------------------------------------------

    def _run(self, buf: str, final: bool) -> None:
        size = len(buf)
        while self.end is None and self.error is None:
            if self._quote:
                if not self._read_literal(buf, final):
                    return
            elif self._token is not None:
                pos = self._token_end(buf, self.pos)
                self.pos = pos
                if pos == size and not final:
                    return
                self._end_token(buf, pos, final)
            elif self._after_literal:
                if not self._adjacent(buf, final):
                    return
            elif self.pos >= size:
                if final:
                    self._fail(size)
                return
            elif buf[self.pos] in _WS:
                self.pos += 1
            else:
                self._char(buf, final)

    def _char(self, buf: str, final: bool) -> None:
        char, expect = buf[self.pos], self._expect
        if expect == _LIST and char == "[":
            self.start = self.pos
            self._deliver("begin", "[")
            self._expect = _CALL_OR_END
            self.pos += 1
        elif expect in (_CALL_OR_END, _KEYWORD_OR_CLOSE) and (char.isidentifier()):
            self._token, self._token_kind = self.pos, "call" if expect == _CALL_OR_END else "keyword"
        elif expect == _CALL_OR_END and char == "]":
            self.start = self.pos
            self._deliver("end")
            self.pos += 1
            self.end = self.pos
        elif expect == _OPEN_PAREN and char == "(":
            self._expect = _KEYWORD_OR_CLOSE
            self.pos += 1
        elif (expect == _KEYWORD_OR_CLOSE or expect == _ARG_NEXT) and char == ")":
            self.start = self.pos
            self._announce()
            self._deliver("end")  # the arguments
            self._deliver("end")  # the call
            self._expect = _CALL_NEXT
            self.pos += 1
        elif expect == _EQUALS and char == "=":
            self._expect = _VALUE
            if self._call is None:  # a later keyword: sent now (the first one waits for its call to start)
                self.start = self.pos
                self._announce()
            self.pos += 1
        elif expect in (_ARG_NEXT, _CALL_NEXT, _NEXT) and char == ",":
            self._comma()
        elif expect == _CALL_NEXT and char == "]":
            self.start = self.pos
            self._deliver("end")
            self.pos += 1
            self.end = self.pos
        elif expect in (_VALUE, _VALUE_OR_CLOSE):
            self._value(buf, char, final)
        elif expect in (_NEXT, _KEY_OR_CLOSE) and self._open and char == _CLOSE[self._open[-1].kind]:
            self._close_value()
        elif expect == _KEY_OR_CLOSE and char in "'\"":
            self._open_literal(buf, self.pos, final, raw=False, key=True)
        elif expect == _COLON and char == ":":
            self._expect = _VALUE
            self.pos += 1
        else:
            self._fail(self.pos)

    def _comma(self) -> None:
        self.pos += 1
        if self._expect == _ARG_NEXT:
            self._expect = _KEYWORD_OR_CLOSE
        elif self._expect == _CALL_NEXT:
            self._expect = _CALL_OR_END
        else:
            frame = self._open[-1]
            if frame.capture is not None:  # `(x,`: a tuple
                events, frame.capture = frame.capture, None
                self.start = self.pos - 1
                self._emit("begin", "[")
                for method, args in events:
                    self._emit(method, *args)
            self._expect = _KEY_OR_CLOSE if frame.kind == "{" else _VALUE_OR_CLOSE

    def _value(self, buf: str, char: str, final: bool) -> None:
        self.start = self.pos
        if self._expect == _VALUE_OR_CLOSE and self._open and char == _CLOSE[self._open[-1].kind]:
            self._close_value()
        elif char in "'\"":
            self._open_literal(buf, self.pos, final, raw=False, key=False)
        elif char in "0123456789.-+":
            self._token, self._token_kind = self.pos, "number"
        elif char.isidentifier():
            self._token, self._token_kind = self.pos, "name"
        elif char in "[({":
            frame = _Frame(char, self.pos)
            if char != "(":
                self._emit("begin", "[" if char == "[" else "{")
            self._open.append(frame)
            self._expect = _KEY_OR_CLOSE if char == "{" else _VALUE_OR_CLOSE
            self.pos += 1
        else:
            self._fail(self.pos)

    def _close_value(self) -> None:
        frame = self._open.pop()
        self.start = self.pos
        self.pos += 1
        if frame.capture is None:
            self._emit("end")
        elif frame.items == 0:  # `()`
            self._emit("begin", "[")
            self._emit("end")
        else:  # `(x)`: just x
            for method, args in frame.capture:
                self._emit(method, *args)
        self._after_value()

    def _after_value(self) -> None:
        if self._open:
            self._open[-1].items += 1
            self._expect = _NEXT
        else:
            self._expect = _ARG_NEXT

    def _token_end(self, buf: str, pos: int) -> int:
        size, number = len(buf), self._token_kind == "number"
        if number and pos == self._token and pos < size and buf[pos] in "+-":
            pos += 1
        while pos < size:
            char = buf[pos]
            exponent_sign = number and char in "+-" and buf[pos - 1] in "eE" and not is_radix(buf[self._token:pos])
            if not (char.isalnum() or char == "_" or (number and char == ".") or exponent_sign):
                break
            pos += 1
        return pos

    def _end_token(self, buf: str, pos: int, final: bool) -> None:
        text, start, kind = buf[self._token:pos], self._token, self._token_kind
        self._token, self.start = None, start
        if kind in ("call", "keyword"):
            if not text.isidentifier() or keyword.iskeyword(text):
                return self._fail(start)
            if kind == "call":
                self._call, self._expect = (text, start), _OPEN_PAREN
            else:
                self._keyword, self._expect = (text, start), _EQUALS
        elif kind == "name" and text in ("r", "R", "u", "U") and pos < len(buf) and buf[pos] in "'\"":
            try:
                self._open_literal(buf, pos, final, raw=text in "rR", key=False)
            except _Wait:
                self._token = start  # read the prefix again
                raise
        elif kind == "name" and text in _NAMES:
            self._emit("scalar", _NAMES[text])
            self._after_value()
        elif kind == "number" and (value := number(text)) is not None:
            self._emit("scalar", value)
            self._after_value()
        else:
            self._fail(start)

    # ---- strings ---------------------------------------------------------------------------------------

    def _open_literal(self, buf: str, pos: int, final: bool, raw: bool, key: bool) -> None:
        """A string literal whose quote is at `pos` (a prefix, if any, is before it); `_Wait` while `''`
        might still become `'''`."""
        quote = buf[pos]
        opening = buf[pos:pos + 3]
        if opening == quote * 3:
            self._quote = quote * 3
        elif not final and len(opening) < 3 and opening == quote * len(opening):
            raise _Wait
        else:
            self._quote = quote
        self._raw = raw
        if self._string is None:  # a new string, not an adjacent literal continuing one
            self._string = "key" if key else "value"
            if key:
                self._key, self._key_start = [], self.pos
            else:
                self._emit("string_start")
        self.pos = pos + len(self._quote)

    def _read_literal(self, buf: str, final: bool) -> bool:
        size, quote = len(buf), self._quote
        while True:
            pos = _PLAIN[quote].match(buf, self.pos).end()
            if pos > self.pos:
                self._part(buf[self.pos:pos])
                self.pos = pos
            if pos >= size:
                if final:
                    self._fail(size)
                return False
            char = buf[pos]
            if char == "\n":
                self._fail(pos)
                return False
            if char == quote[0]:
                if buf.startswith(quote, pos):
                    self.pos = pos + len(quote)
                    self._quote, self._after_literal = "", True
                    return True
                if not final and quote.startswith(buf[pos:]):
                    return False  # maybe the closing triple quote, cut short
                self._part(char)
                self.pos += 1
                continue
            decoded, used = escape(buf, pos, final, self._raw)
            if used is None:
                if final:
                    self._fail(pos)
                return False
            if not used:
                self._fail(pos)
                return False
            self._part(decoded)
            self.pos += used

    def _part(self, text: str) -> None:
        if not text:
            return
        if self._string == "key":
            self._key.append(text)
        else:
            self._emit("string_part", text)

    def _adjacent(self, buf: str, final: bool) -> bool:
        """After a literal: another one continues the string; anything else ends it."""
        size, pos = len(buf), self.pos
        while pos < size and buf[pos] in _WS:
            pos += 1
        if pos >= size or (buf[pos] in "rRuU" and pos + 1 >= size):
            if not final:
                return False
        elif buf[pos] in "'\"":
            self._open_literal(buf, pos, final, raw=False, key=self._string == "key")
            self._after_literal = False
            return True
        elif buf[pos] in "rRuU" and buf[pos + 1] in "'\"":
            self._open_literal(buf, pos + 1, final, raw=buf[pos] in "rR", key=self._string == "key")
            self._after_literal = False
            return True
        self._after_literal = False
        if self._string == "key":
            self.start, self._string = pos, None  # a repeated key stops after itself: it has been sent
            self._emit("key", "".join(self._key))
            self._expect = _COLON
        else:
            self._string = None
            self._emit("string_end")
            self._after_value()
        return True

    # ---- reporting -------------------------------------------------------------------------------------

    def _emit(self, method: str, *args: Any) -> None:
        """Report a value event, or keep it in the innermost undecided parenthesis."""
        for frame in reversed(self._open):
            if frame.capture is not None:
                frame.capture.append((method, args))
                return
        self._announce()
        self._deliver(method, *args)

    def _announce(self) -> None:
        """Report the call and the keyword that the first value (or the closing parenthesis) confirms."""
        start = self.start
        if self._call is not None:
            (name, self.start), self._call = self._call, None
            for method, args in (("begin", ("{",)), ("key", ("name",)), ("string_start", ()),
                                 ("string_part", (name,)), ("string_end", ()), ("key", ("arguments",)),
                                 ("begin", ("{",))):
                self._deliver(method, *args)
        if self._keyword is not None:
            name, self._keyword = self._keyword[0], None  # a repeated keyword stops after itself: it was sent
            self._deliver("key", name)
        self.start = start

    def _deliver(self, method: str, *args: Any) -> None:
        getattr(self.handler, method)(*args)
        if method == "begin":
            self.stack.append(args[0])
        elif method == "end":
            self.stack.pop()
