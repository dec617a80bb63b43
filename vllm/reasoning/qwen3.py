"""`qwen3`: Qwen3's `<think>`...`</think>` reasoning, with the prompt deciding where
the output starts.

What it owns: how the Qwen3 family's chat templates end the generation prompt, and
what that means for the output:
- prompt ends with `<think>` (Qwen3-Thinking-2507, Qwen3.5): the output starts inside
  the reasoning block and only `</think>` appears in it;
- prompt ends with an empty, closed block `<think>\\n\\n</think>\\n\\n`
  (`enable_thinking=False`): no reasoning, the whole output is content;
- prompt ends with neither (original Qwen3 hybrid models with thinking on, which
  write `<think>` themselves; non-thinking models such as Qwen3-Instruct-2507): the
  output is reasoning only if it opens with `<think>` (leading whitespace allowed),
  otherwise it is all content;
- prompt unknown (None): vLLM's current default (thinking enabled): reasoning until
  `</think>`, a `<think>` anywhere in the reasoning deleted, no `</think>` at all
  (truncated) means all reasoning.
After `</think>` the rest is content verbatim; whitespace around the markers is kept
(Qwen3 writes `<think>\\n...\\n</think>\\n\\n`, so content starts with "\\n\\n", as
vLLM returns it).

vLLM reads `enable_thinking` from `chat_template_kwargs` instead of the prompt; with
thinking disabled it returns all content unless the output contains `</think>`
(where it splits). We treat a prompt-closed block as final: the output is content.
vLLM's `<tool_call>`-ends-reasoning rule for Qwen3.5 (a tool call written inside an
unclosed think block) is not implemented: such a call stays in the reasoning.
"""

from __future__ import annotations

from typing import Optional

from vllm.reasoning.base import CONTENT, REASONING, prompt_tail
from vllm.reasoning.deepseek_r1 import OPENING, ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    name = "qwen3"

    def initial_phase(self, prompt: Optional[str]) -> str:
        tail = prompt_tail(prompt)
        if tail is None:
            return REASONING
        if tail.endswith(self.end_marker):
            return CONTENT
        if tail.endswith(self.start_marker):
            return REASONING
        return OPENING
