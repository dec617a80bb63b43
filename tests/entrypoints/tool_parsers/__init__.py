"""Tests of the tool-call parsers, and the checks they share: a recorded output is parsed whole, then
streamed in every way of cutting it (two chunks at every index, one character at a time, seeded random
chunks), and every stream must agree with the whole parse: the same content once concatenated, the same
calls with identical argument strings, in vLLM's delta shapes (a call's first delta has its id and name,
the later ones only its index and the next non-empty piece of its arguments)."""

from __future__ import annotations

import json
import random
import re
from typing import Any, Callable, Iterator, Optional, Union

from vllm.entrypoints.openai.tool_parsers import StreamDelta, ToolParser

TOOL_CALL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{32}$")
# Samples whose arguments arrive in one piece: written as a JSON string (read back when it closes), or
# before the name (sent with it).
WHOLE_ARGUMENTS = {"stringified_arguments", "arguments_before_name", "arguments_first"}
# (sample id, model output, expected content, expected [(name, arguments)]): arguments as a dict, or as the
# exact string of a call that broke after it started (see `call_stream`), which need not be valid JSON.
Sample = tuple[str, str, Optional[str], list[tuple[str, Union[dict[str, Any], str]]]]


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    """Every two-chunk split, one character at a time, and 20 random chunkings."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        chunks, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, 12)
            chunks.append(text[pos:pos + size])
            pos += size
        yield chunks


def stream(parser: ToolParser, chunks: list[str]) -> tuple[str, list[dict[str, Any]], list[StreamDelta]]:
    """Feed `chunks`, then finish: the concatenated content, the calls assembled from the OpenAI-shaped
    deltas (as a client does; `pieces`: how many deltas brought arguments), and the deltas."""
    deltas = [parser.extract_streaming(chunk) for chunk in chunks] + [parser.finish()]
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        assert delta.content != "", "an empty content delta must be None"
        for piece in delta.tool_calls:
            data = piece.to_openai()
            if data["index"] == len(calls):  # a new call: its first delta has id, type and name
                assert set(data) == {"index", "id", "type", "function"} and data["type"] == "function"
                assert TOOL_CALL_ID.match(data["id"]) and data["function"]["name"]
                assert set(data["function"]) == {"name", "arguments"}
                calls.append({"id": data["id"], "name": data["function"]["name"],
                              "arguments": [data["function"]["arguments"]]})
            else:
                assert data["index"] == len(calls) - 1 and set(data) == {"index", "function"}
                assert set(data["function"]) == {"arguments"} and data["function"]["arguments"]
                calls[-1]["arguments"].append(data["function"]["arguments"])
    for call in calls:
        call["pieces"] = sum(1 for piece in call["arguments"] if piece)
        call["arguments"] = "".join(call["arguments"])
    return "".join(d.content or "" for d in deltas), calls, deltas


def check_sample(make_parser: Callable[[], ToolParser], sample: Sample) -> None:
    """The whole parse gives the expected content and calls, and every stream gives the same."""
    _, text, content, expected_calls = sample
    whole = make_parser().extract_tool_calls(text)
    assert whole.content == content
    assert whole.tools_called == bool(expected_calls)
    assert [(c.name, c.arguments if isinstance(args, str) else json.loads(c.arguments))
            for c, (_, args) in zip(whole.tool_calls, expected_calls)] == expected_calls
    assert len(whole.tool_calls) == len(expected_calls)
    for call in whole.tool_calls:
        assert TOOL_CALL_ID.match(call.id)
        assert call.to_openai() == {"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
    if not expected_calls:
        assert whole.content == text  # without a call the text is untouched
    for call in whole.tool_calls:  # json.dumps form, unless broken
        assert call.arguments in [args for _, args in expected_calls] or \
            call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    for chunks in splits(text):
        streamed_content, calls, _ = stream(make_parser(), chunks)
        if chunks == list(text) and sample[0] not in WHOLE_ARGUMENTS:  # generated a character at a time
            assert all(c["pieces"] > 1 for c in calls if len(c["arguments"]) > 10), calls
        assert streamed_content == (whole.content or ""), chunks
        assert [(c["name"], c["arguments"]) for c in calls] == \
               [(c.name, c.arguments) for c in whole.tool_calls], chunks
