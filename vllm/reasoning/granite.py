"""`granite`: IBM Granite 3.x thinking output.

What it owns: the two shapes a Granite 3.x model writes when its template asks it
to think (`chat_template_kwargs={"thinking": true}`):
- Granite 3.2, plain phrases (vLLM's `granite` parser):
  "Here is my thought process:" <reasoning> "Here is my response:" <content>,
  each phrase also accepted with "Here's" (vLLM: seen from quantized models);
  exact case and spacing, no other variants (as vLLM).
- Granite 3.3, tags: "<think>" <reasoning> "</think>" then "<response>" <content>
  "</response>" (not handled by vLLM's parser, which returns such output as content
  with its tags).

Behaviour:
- The output must open with a thought marker (leading whitespace allowed and
  dropped); otherwise nothing is reasoning and the output is content verbatim
  (vLLM: the same when streaming; its non-streamed regex also finds the phrases
  later in the text, dropping what precedes them).
- Reasoning runs to the first response phrase (3.2) or `</think>` (3.3); the rest
  is content. Text is not stripped: "Here is my thought process:\\nA\\n\\nHere is my
  response:\\nB" gives reasoning "\\nA\\n\\n", content "\\nB" (as vLLM).
- No response marker (truncated): all of it is reasoning (vLLM streams it as
  reasoning but, non-streamed, returns the whole text, phrase included, as content).
- An output that opens with a response marker (the model skipped thinking) is
  content after the marker. In 3.3 content, `<response>`/`</response>` are deleted.
"""

from __future__ import annotations

from typing import Optional

from vllm.reasoning.base import CONTENT, REASONING, ReasoningParser, Step, opening, scan

OPENING = "opening"
REASONING_TAGS = "reasoning_tags"  # Granite 3.3: inside <think>
CONTENT_TAGS = "content_tags"  # Granite 3.3: after </think>

THOUGHT_PHRASES = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_PHRASES = ("Here is my response:", "Here's my response:")
THINK_START, THINK_END = "<think>", "</think>"
RESPONSE_START, RESPONSE_END = "<response>", "</response>"

# Opening marker -> phase it leads to.
_OPENERS = {
    **{p: REASONING for p in THOUGHT_PHRASES},
    **{p: CONTENT for p in RESPONSE_PHRASES},
    THINK_START: REASONING_TAGS,
    RESPONSE_START: CONTENT_TAGS,
}


class GraniteReasoningParser(ReasoningParser):
    """Phases: "opening" -> "reasoning" -> "content" (3.2 phrases) or
    "opening" -> "reasoning_tags" -> "content_tags" (3.3 tags)."""

    name = "granite"

    def initial_phase(self, prompt: Optional[str]) -> str:
        return OPENING

    def is_content_phase(self, phase: str) -> bool:
        return phase in (CONTENT, CONTENT_TAGS)

    def step(self, phase: str, text: str, final: bool) -> Step:
        if phase == OPENING:
            opened = opening(text, tuple(_OPENERS), final)
            if opened is not None:
                marker, consumed = opened
                return Step("", "", consumed, _OPENERS[marker] if marker else CONTENT)
            return Step("", "", 0, OPENING)
        if phase == REASONING:
            reasoning, consumed, stop = scan(text, RESPONSE_PHRASES, (), final)
            return Step(reasoning, "", consumed, CONTENT if stop else REASONING)
        if phase == REASONING_TAGS:
            reasoning, consumed, stop = scan(text, (THINK_END,), (THINK_START,), final)
            return Step(reasoning, "", consumed, CONTENT_TAGS if stop else REASONING_TAGS)
        if phase == CONTENT_TAGS:
            content, consumed, _ = scan(text, (), (RESPONSE_START, RESPONSE_END), final)
            return Step("", content, consumed, CONTENT_TAGS)
        return Step("", text, len(text), CONTENT)
