"""Tool-call parsers: `--enable-auto-tool-choice --tool-call-parser NAME`, as in vLLM.

What it owns: the registry of the formats this server reads (`TOOL_PARSERS`, vLLM's names) and
`get_tool_parser`, which makes the per-request parser. The formats are pure functions of the generated text
(see `base` for the streaming contract); `tool_choice` holds the schemas for `tool_choice="required"` and a
named function.
"""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
)
from vllm.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from vllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from vllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from vllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "granite": GraniteToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "llama4_pythonic": PythonicToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """A new parser for one request (its streaming state is the request's)."""
    try:
        parser_class = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown tool call parser {name!r}; supported: {', '.join(sorted(TOOL_PARSERS))}") \
            from None
    return parser_class(tokenizer)


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "GraniteToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "PythonicToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "make_tool_call_id",
]
