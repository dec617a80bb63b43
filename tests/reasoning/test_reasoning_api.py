"""The registry (vLLM's parser names, ValueError for unknown ones) and the streaming
object's contract: per-request state, `finish()` once, phases."""

from __future__ import annotations

import pytest

from vllm.reasoning import (DeepSeekR1ReasoningParser, GraniteReasoningParser, Qwen3ReasoningParser,
                            ReasoningDelta, ReasoningParser, create_reasoning_parser, get_reasoning_parser,
                            register_reasoning_parser, supported_reasoning_parsers)


def test_registry_names():
    assert supported_reasoning_parsers() == ["deepseek_r1", "granite", "qwen3"]
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert get_reasoning_parser("granite") is GraniteReasoningParser
    assert isinstance(create_reasoning_parser("granite"), GraniteReasoningParser)


@pytest.mark.parametrize("name", ["nope", "Qwen3", "deepseek-r1", ""])
def test_unknown_name_lists_supported(name):
    with pytest.raises(ValueError) as err:
        get_reasoning_parser(name)
    message = str(err.value)
    assert repr(name) in message
    for supported in supported_reasoning_parsers():
        assert supported in message


def test_register_refuses_nameless_and_duplicates():
    class Nameless(ReasoningParser):
        def initial_phase(self, prompt):
            return "content"

        def step(self, phase, text, final):
            raise NotImplementedError

    with pytest.raises(ValueError):
        register_reasoning_parser(Nameless)

    class Clash(Nameless):
        name = "qwen3"

    with pytest.raises(ValueError, match="already registered"):
        register_reasoning_parser(Clash)
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser


def test_one_parser_serves_interleaved_requests():
    parser = create_reasoning_parser("qwen3")
    thinking, plain = parser.stream("assistant\n<think>\n"), parser.stream("assistant\n<think>\n\n</think>\n\n")
    assert (thinking.reasoning_ended, plain.reasoning_ended) == (False, True)
    assert thinking.extract_streaming("a</th") == ReasoningDelta(reasoning="a")
    assert plain.extract_streaming("a</th") == ReasoningDelta(content="a</th")
    assert thinking.extract_streaming("ink>b") == ReasoningDelta(content="b")
    assert (thinking.phase, plain.phase) == ("content", "content")
    assert thinking.reasoning_ended
    assert thinking.finish().is_empty and plain.finish().is_empty


def test_finish_flushes_once_and_ends_the_stream():
    stream = create_reasoning_parser("deepseek_r1").stream()
    assert stream.phase == "reasoning"
    assert stream.extract_streaming("x<").reasoning == "x"
    assert stream.finish() == ReasoningDelta(reasoning="<")
    assert stream.finish() == ReasoningDelta()
    with pytest.raises(RuntimeError):
        stream.extract_streaming("more")


def test_extract_reasoning_is_pure():
    parser = create_reasoning_parser("granite")
    text = "Here is my thought process: a Here is my response: b"
    assert parser.extract_reasoning(text) == parser.extract_reasoning(text) == (" a ", " b")


@pytest.mark.parametrize("prompt, expected", [
    (None, ("plain answer", None)),                      # unknown prompt: vLLM's default, reasoning
    ("<|im_start|>assistant\n", (None, "plain answer")),  # template did not open a block, nor the model
    ("<|im_start|>assistant\n<think>\n", ("plain answer", None)),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", (None, "plain answer")),
])
def test_qwen3_prompt_decides_where_output_starts(prompt, expected):
    assert create_reasoning_parser("qwen3").extract_reasoning("plain answer", prompt) == expected


def test_deepseek_r1_ignores_an_unopened_prompt():
    parser = create_reasoning_parser("deepseek_r1")
    assert parser.extract_reasoning("thinking", "<｜Assistant｜>") == ("thinking", None)
    assert parser.extract_reasoning("answer", "<｜Assistant｜></think>") == (None, "answer")


@pytest.mark.parametrize("deltas, ended", [
    (["Here is my thought process: a"], [False]),
    (["Here is my thought process: a", "Here is my response:"], [False, True]),
    (["<think>a", "</think>", "<response>b"], [False, True, True]),
    (["Hi"], [True]),
    (["Here"], [False]),
])
def test_granite_reasoning_ended(deltas, ended):
    stream = create_reasoning_parser("granite").stream()
    assert [(stream.extract_streaming(d), stream.reasoning_ended)[1] for d in deltas] == ended
