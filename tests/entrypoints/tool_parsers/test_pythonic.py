"""`pythonic`: Python call lists (Llama 3.2/4, ToolACE), literal arguments only, parsed whole and streamed in
every split."""

from __future__ import annotations

import pytest

from tests.entrypoints.tool_parsers import Sample, check_sample
from vllm.entrypoints.openai.tool_parsers import PythonicToolParser, get_tool_parser

SF = {"city": "San Francisco", "unit": "celsius"}
WEATHER = '[get_weather(city="San Francisco", unit="celsius")]'

SAMPLES: list[Sample] = [
    ("single", WEATHER, None, [("get_weather", SF)]),
    ("several", '[get_weather(city="San Francisco", unit="celsius"), get_time(tz=\'America/Los_Angeles\')]', None,
     [("get_weather", SF), ("get_time", {"tz": "America/Los_Angeles"})]),
    ("no_arguments", "[get_time()]", None, [("get_time", {})]),
    ("literals", "[book(seats=-2, price=+19.5, ok=True, note=None, flag=false, extra=null, ids=(1, 2), "
                 "opts={'window': True, 'meal': [\"veg\", 'kosher']})]", None,
     [("book", {"seats": -2, "price": 19.5, "ok": True, "note": None, "flag": False, "extra": None,
                "ids": [1, 2], "opts": {"window": True, "meal": ["veg", "kosher"]}})]),
    ("unicode_escapes", "[send(to='Zoë', body=\"Il a dit \\\"bonjour\\\" ☀\\n\", path=r'C:\\tmp', q='it\\'s')]",
     None, [("send", {"to": "Zoë", "body": 'Il a dit "bonjour" ☀\n', "path": "C:\\tmp", "q": "it's"})]),
    ("triple_quoted", "[run(code='''print(\"a]\")\nx = ')'\n''', lang=\"\"\"py\"\"\")]", None,
     [("run", {"code": "print(\"a]\")\nx = ')'\n", "lang": "py"})]),
    ("multiline_list", "[\n  get_weather(\n    city=\"San Francisco\",\n    unit=\"celsius\",\n  ),\n]", None,
     [("get_weather", SF)]),
    ("llama4_markers", "<|python_start|>" + WEATHER + "<|python_end|>", None, [("get_weather", SF)]),
    ("text_before_marker", "Checking now. <|python_start|>" + WEATHER + "<|python_end|>", "Checking now.",
     [("get_weather", SF)]),
    ("leading_whitespace_and_text_after", "\n " + WEATHER + "\nDone.", "Done.", [("get_weather", SF)]),
    ("no_call", "It is 18°C in San Francisco.", "It is 18°C in San Francisco.", []),
    ("citation", "[1] See the docs.", "[1] See the docs.", []),
    ("bracket_words", "[Note] this is text", "[Note] this is text", []),
    ("empty_list", "[]", "[]", []),
    ("positional_argument", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("variable_argument", "[get_weather(city=paris)]", "[get_weather(city=paris)]", []),
    ("call_argument", "[f(x=g())]", "[f(x=g())]", []),
    ("fstring_argument", "[f(x=f'{a}')]", "[f(x=f'{a}')]", []),
    ("attribute_function", "[math.sqrt(x=4)]", "[math.sqrt(x=4)]", []),
    ("kwargs_unpacking", "[f(**opts)]", "[f(**opts)]", []),
    ("infinite_float", "[f(x=1e999)]", "[f(x=1e999)]", []),
    # Once a call has started it stands with the arguments sent; the rest is text again.
    ("mismatched_brackets", "[f(x=[1, 2)]", ")]", [("f", '{"x": [1, 2')]),
    ("truncated", '[get_weather(city="San Fr', None, [("get_weather", '{"city": "San Fr')]),
    ("second_call_positional", '[f(a=1), g("x")]', 'g("x")]', [("f", {"a": 1})]),
    ("call_in_later_argument", "[f(a=1, b=g())]", "g())]", [("f", '{"a": 1, "b": ')]),
    ("repeated_keyword", "[f(a=1, a=2)]", "=2)]", [("f", '{"a": 1, "a"')]),
    ("tuples_and_parentheses", "[f(t=(1, 'a'), p=(2), e=(), n=((3,),), s=('x' 'y'), d={'k': (1,)})]", None,
     [("f", {"t": [1, "a"], "p": 2, "e": [], "n": [[3]], "s": "xy", "d": {"k": [1]}})]),
    ("undecided_parenthesis_truncated", "[f(a=1, t=(1", "(1", [("f", '{"a": 1, "t": ')]),
    ("python_escapes", "[f(s='\\x41\\101\\u00e9\\N{BULLET}\\q\\\n!', n=0x1F, m=1_000, k=.5)]", None,
     [("f", {"s": "AAé•\\q!", "n": 31, "m": 1000, "k": 0.5})]),
    ("unicode_kept", "[f(s='日本 ☀', t=\"\\ud83c\")]", None, [("f", {"s": "日本 ☀", "t": "\ud83c"})]),
    ("not_at_start", "Call " + WEATHER, "Call " + WEATHER, []),
]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_sample_whole_and_streamed(sample):
    check_sample(PythonicToolParser, sample)


def test_llama4_pythonic_is_the_same_format():
    assert type(get_tool_parser("llama4_pythonic")) is PythonicToolParser


def test_a_list_that_cannot_hold_calls_is_released_at_once():
    parser = get_tool_parser("pythonic")
    assert parser.extract_streaming("[").content is None
    assert parser.extract_streaming("2").content == "[2"
    parser = get_tool_parser("pythonic")
    assert parser.extract_streaming("[get_time(").content is None
    assert parser.extract_streaming(")]").tool_calls[0].name == "get_time"
