"""Python literal tokens for `python_stream`: what a number literal or a string escape stands for.

What it owns: `number` (a signed int or finite float literal, read by `ast`, never evaluated), `escape`
(a backslash sequence of a string literal, as Python reads it, or "cut short" while more text could
complete it) and `is_radix`.

Invariants: the values are exactly `ast`'s: `\\q` keeps its backslash, `\\N{...}` is looked up by name,
octal escapes take up to three digits; nothing returned can be changed by text after it.
"""

from __future__ import annotations

import ast
import math
import re
import unicodedata
from typing import Any, Optional

_ESCAPES = {"\n": "", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t", "v": "\v"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_HEX = frozenset("0123456789abcdefABCDEF")
_OCTAL = frozenset("01234567")


def is_radix(text: str) -> bool:
    """A hexadecimal, octal or binary literal (where `e` is a digit, not an exponent)."""
    return text.lstrip("+-")[:2].lower() in ("0x", "0o", "0b")


def number(text: str) -> Any:
    """The int or finite float a (signed) Python number literal stands for, else None."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign, node = (-1 if isinstance(node.op, ast.USub) else 1), node.operand
    if not isinstance(node, ast.Constant) or type(node.value) not in (int, float):
        return None
    value = sign * node.value
    return value if not isinstance(value, float) or math.isfinite(value) else None


def escape(buf: str, pos: int, final: bool, raw: bool) -> tuple[str, Optional[int]]:
    """What the backslash sequence at `pos` stands for and its length (None: cut short, 0: invalid)."""
    if pos + 1 >= len(buf):
        return "", None
    kind = buf[pos + 1]
    if raw:
        return "\\" + kind, 2
    if kind in _ESCAPES:
        return _ESCAPES[kind], 2
    if kind in _OCTAL:
        digits = re.match(r"[0-7]{1,3}", buf[pos + 1:pos + 4]).group()
        if len(digits) < 3 and pos + 1 + len(digits) >= len(buf) and not final:
            return "", None
        return chr(int(digits, 8)), 1 + len(digits)
    if kind in _HEX_DIGITS:
        digits = buf[pos + 2:pos + 2 + _HEX_DIGITS[kind]]
        if not all(d in _HEX for d in digits):
            return "", 0
        if len(digits) < _HEX_DIGITS[kind]:
            return "", 0 if final else None
        code = int(digits, 16)
        return (chr(code), 2 + len(digits)) if code <= 0x10FFFF else ("", 0)
    if kind == "N":
        close = buf.find("}", pos)
        if not buf.startswith("{", pos + 2) and pos + 2 < len(buf):
            return "", 0
        if close < 0:
            return "", 0 if final or len(buf) - pos > 100 else None
        try:
            return unicodedata.lookup(buf[pos + 3:close]), close + 1 - pos
        except KeyError:
            return "", 0
    return "\\" + kind, 2  # an unknown escape keeps its backslash
