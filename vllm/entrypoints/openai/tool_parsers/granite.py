"""`granite`: IBM Granite 3.x and 4.x tool calls.

What it owns: the markers and shapes of every Granite generation, on top of `hermes`'s tagged-JSON parsing:
- Granite 3.0: the special token `<|tool_call|>` then a JSON array of calls,
  `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`; with special tokens skipped in detokenisation
  (the server's default) only the array is left, so an output that opens with `[` is a call list.
- Granite 3.1-3.3: the string `<tool_call>` then the same array, usually without a closing tag.
- Granite 4.x: Hermes style, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call.
Text before the marker is content (vLLM's parser requires the marker first; this is a superset).

Invariants: `hermes`'s. An opening `[` that is not a list of calls (an answer that is a JSON array) is text.
"""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser


class GraniteToolParser(HermesToolParser):
    name = "granite"
    START = ("<|tool_call|>", "<tool_call>")
    BARE_ARRAY = True
