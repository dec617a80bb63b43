"""`deepseek_r1`: `<think>`...`</think>` reasoning that the chat template has opened.

What it owns: the think-tag grammar shared with `qwen3` (`ThinkTagReasoningParser`)
and DeepSeek-R1's reading of it. R1's template ends the generation prompt with
`<think>\\n`, so the output starts inside the reasoning block; older templates let
the model write `<think>` itself.

Behaviour (vLLM's `deepseek_r1`, whose parser is the basic think-tag parser):
- Everything up to the first `</think>` is reasoning; everything after it is content,
  verbatim (markers after `</think>` are content text, as in vLLM).
- No `</think>` (truncated, or still thinking): all of it is reasoning.
- `<think>` inside the reasoning is deleted (vLLM strips the first one and drops any
  text before it; we keep that text, which only matters for malformed output).
- A prompt whose end is `</think>` (a template that closed the block, e.g. thinking
  turned off) makes the whole output content, as vLLM's prompt check does; we look
  only at the end of the prompt, where vLLM scans the whole prompt for the last
  marker (which misfires on prompts that keep earlier turns' think blocks).
"""

from __future__ import annotations

from typing import ClassVar, Optional

from vllm.reasoning.base import CONTENT, REASONING, ReasoningParser, Step, opening, prompt_tail, scan

OPENING = "opening"


class ThinkTagReasoningParser(ReasoningParser):
    """`<think>`/`</think>` reasoning. Phases: "opening" (only where a subclass's
    `initial_phase` asks for it: the output must open with `<think>` to be reasoning)
    -> "reasoning" -> "content"."""

    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"

    def initial_phase(self, prompt: Optional[str]) -> str:
        tail = prompt_tail(prompt)
        if tail is not None and tail.endswith(self.end_marker):
            return CONTENT
        return REASONING

    def step(self, phase: str, text: str, final: bool) -> Step:
        if phase == OPENING:
            opened = opening(text, (self.start_marker,), final)
            if opened is not None:
                marker, consumed = opened
                return Step("", "", consumed, REASONING if marker else CONTENT)
            return Step("", "", 0, OPENING)
        if phase == REASONING:
            reasoning, consumed, stop = scan(text, (self.end_marker,), (self.start_marker,), final)
            return Step(reasoning, "", consumed, CONTENT if stop else REASONING)
        return Step("", text, len(text), CONTENT)


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    name = "deepseek_r1"
