"""Reasoning parsers (`--reasoning-parser NAME`): split generated text into the
thinking (`message.reasoning`) and the answer (`message.content`).

What it owns: the registry of parser names (vLLM's names) and the lookup used by the
CLI and the chat endpoint. The parsers themselves are pure functions of text (see
`vllm.reasoning.base`): one instance can serve every request; per-request streaming
state lives in `parser.stream(prompt)`.

Invariants: names are case-sensitive and unique; an unknown name raises `ValueError`
naming it and listing the supported names (the CLI turns that into its error).
"""

from __future__ import annotations

from vllm.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from vllm.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from vllm.reasoning.granite import GraniteReasoningParser
from vllm.reasoning.qwen3 import Qwen3ReasoningParser

_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    """Add a parser class under `cls.name` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if _PARSERS.get(cls.name, cls) is not cls:
        raise ValueError(f"reasoning parser {cls.name!r} is already registered")
    _PARSERS[cls.name] = cls
    return cls


for _cls in (DeepSeekR1ReasoningParser, GraniteReasoningParser, Qwen3ReasoningParser):
    register_reasoning_parser(_cls)


def supported_reasoning_parsers() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError for an unknown name."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown reasoning parser {name!r}; supported: "
                         f"{', '.join(supported_reasoning_parsers())}") from None


def create_reasoning_parser(name: str) -> ReasoningParser:
    """An instance of the parser registered as `name` (shareable across requests)."""
    return get_reasoning_parser(name)()


__all__ = [
    "DeepSeekR1ReasoningParser",
    "GraniteReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "create_reasoning_parser",
    "get_reasoning_parser",
    "register_reasoning_parser",
    "supported_reasoning_parsers",
]
