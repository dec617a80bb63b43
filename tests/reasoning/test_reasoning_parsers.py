"""Reasoning parsers on recorded outputs: the non-streamed split, and the same output
streamed in every way (two chunks split at every index, char by char, random chunk
sizes, three chunks around each marker): streamed pieces concatenate to the
non-streamed fields, and no marker text reaches either field or any piece."""

from __future__ import annotations

import random
from typing import Optional, Sequence

import pytest

from tests.reasoning.cases import CASES, Case
from vllm.reasoning import create_reasoning_parser

PARAMS = [pytest.param(name, case, markers, id=f"{name}-{case.id}")
          for name, (cases, markers) in CASES.items() for case in cases]


def stream_chunks(name: str, prompt: Optional[str], chunks: Sequence[str]):
    """Feed chunks to a fresh stream; returns (reasoning pieces, content pieces)."""
    stream = create_reasoning_parser(name).stream(prompt)
    reasoning, content = [], []
    for delta in [stream.extract_streaming(c) for c in chunks] + [stream.finish()]:
        for piece, out in ((delta.reasoning, reasoning), (delta.content, content)):
            if piece is not None:
                assert piece, "empty pieces are reported as None"
                out.append(piece)
    return reasoning, content


def splittings(text: str):
    """Every 2-chunk split, char by char, random chunk sizes, and 3-chunk splits
    with one cut inside each `<...>`-ish or 'Here' marker region."""
    yield "whole", [text]
    for i in range(len(text) + 1):
        yield f"split@{i}", [text[:i], text[i:]]
    yield "chars", list(text)
    rng = random.Random(len(text))
    for k in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        yield f"random{k}", [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    starts = [i for i, ch in enumerate(text) if ch in "<H"]
    for s in starts:
        for i in range(s, min(s + 28, len(text)) + 1):
            for j in range(i, min(s + 28, len(text)) + 1, 3):
                yield f"three@{i},{j}", [text[:i], text[i:j], text[j:]]


def assert_no_markers(text: Optional[str], markers: Sequence[str], where: str) -> None:
    for marker in markers:
        assert marker not in (text or ""), f"marker {marker!r} leaked into {where}: {text!r}"


@pytest.mark.parametrize("name, case, markers", PARAMS)
def test_non_streamed(name: str, case: Case, markers):
    parser = create_reasoning_parser(name)
    assert parser.extract_reasoning(case.output, prompt=case.prompt) == (case.reasoning, case.content)
    assert_no_markers(case.reasoning, markers, "reasoning")
    if not case.markers_in_content:
        assert_no_markers(case.content, markers, "content")


@pytest.mark.parametrize("name, case, markers", PARAMS)
def test_streamed_every_split(name: str, case: Case, markers):
    for label, chunks in splittings(case.output):
        assert "".join(chunks) == case.output
        reasoning, content = stream_chunks(name, case.prompt, chunks)
        assert ("".join(reasoning) or None, "".join(content) or None) == (case.reasoning, case.content), label
        for piece in reasoning:
            assert_no_markers(piece, markers, f"a reasoning piece ({label})")
        if not case.markers_in_content:
            for piece in content:
                assert_no_markers(piece, markers, f"a content piece ({label})")


@pytest.mark.parametrize("name, prompt, deltas, expected", [
    # Text that cannot start a marker is emitted at once; a possible marker start is held.
    ("qwen3", "assistant\n<think>\n", ["abc", "</th", "ink>\n", "ok"],
     [("abc", None), (None, None), (None, "\n"), (None, "ok"), (None, None)]),
    ("qwen3", "assistant\n<think>\n", ["a<", "b"], [("a", None), ("<b", None), (None, None)]),
    ("qwen3", "assistant\n", ["<thi", "nk>r", "</think>c"], [(None, None), ("r", None), (None, "c"), (None, None)]),
    ("qwen3", "assistant\n", ["<thi", "s"], [(None, None), (None, "<this"), (None, None)]),
    ("deepseek_r1", None, ["x</think", ""], [("x", None), (None, None), ("</think", None)]),
    ("granite", None, ["Here is my ", "thought process:", " a Here", "'s my response:", " b"],
     [(None, None), (None, None), (" a ", None), (None, None), (None, " b"), (None, None)]),
    ("granite", None, ["Here is my ", "plan"], [(None, None), (None, "Here is my plan"), (None, None)]),
])
def test_streaming_holds_only_possible_markers(name, prompt, deltas, expected):
    stream = create_reasoning_parser(name).stream(prompt)
    got = [stream.extract_streaming(d) for d in deltas] + [stream.finish()]
    assert [(d.reasoning, d.content) for d in got] == expected
