"""Recorded outputs per reasoning format, with the rendered prompt's end and the
expected non-streamed (reasoning, content).

Outputs are shaped like real generations of each family (Qwen3 writes
`<think>\\n...\\n</think>\\n\\n`, DeepSeek-R1 starts inside the block its template
opened, Granite 3.2 writes the two phrases on their own lines, Granite 3.3 uses tags).
`markers_in_content` marks the cases that document verbatim text after the end of
reasoning (markers there are the answer's text, not markers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Case:
    id: str
    output: str
    reasoning: Optional[str]
    content: Optional[str]
    prompt: Optional[str] = None
    markers_in_content: bool = False


# Ends of rendered prompts (what each template's generation prompt looks like).
QWEN_PLAIN = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN_OPEN = QWEN_PLAIN + "<think>\n"
QWEN_CLOSED = QWEN_PLAIN + "<think>\n\n</think>\n\n"
R1_OPEN = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
R1_PLAIN = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"
R1_CLOSED = R1_PLAIN + "</think>"

THINK_MARKERS = ("<think>", "</think>")
GRANITE_MARKERS = ("Here is my thought process:", "Here's my thought process:", "Here is my response:",
                   "Here's my response:", "<think>", "</think>", "<response>", "</response>")

QWEN3 = [
    Case("hybrid_thinking", "<think>\nThe user asks 2+2. That is 4.\n</think>\n\n2 + 2 = **4**.",
         "\nThe user asks 2+2. That is 4.\n", "\n\n2 + 2 = **4**.", QWEN_PLAIN),
    Case("thinking_disabled_by_template", "2 + 2 = 4.", None, "2 + 2 = 4.", QWEN_CLOSED),
    Case("disabled_output_mentions_tags", "Use <think> tags.", None, "Use <think> tags.", QWEN_CLOSED,
         markers_in_content=True),
    Case("think_open_in_prompt", "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.",
         "Okay, 2+2 is 4.\n", "\n\nThe answer is 4.", QWEN_OPEN),
    Case("truncated_in_reasoning", "Let me think about 東京 and 🙂 first", "Let me think about 東京 and 🙂 first",
         None, QWEN_OPEN),
    Case("truncated_mid_end_marker", "Thinking</thi", "Thinking</thi", None, QWEN_OPEN),
    Case("truncated_after_start_marker", "<think>", None, None, QWEN_PLAIN),
    Case("unknown_prompt_no_tags_is_reasoning", "Just some text", "Just some text", None),
    Case("unknown_prompt_end_without_start", "reasoning here</think>answer", "reasoning here", "answer"),
    Case("unknown_prompt_both_tags", "<think>reasoning</think>answer", "reasoning", "answer"),
    Case("non_thinking_model", "Hello! How can I help you today?", None, "Hello! How can I help you today?",
         QWEN_PLAIN),
    Case("non_thinking_model_starts_with_lt", "<b>bold</b> answer", None, "<b>bold</b> answer", QWEN_PLAIN),
    Case("thinking_tag_is_not_think", "<thinking>no</thinking>", None, "<thinking>no</thinking>", QWEN_PLAIN),
    Case("soft_no_think_empty_block", "<think>\n\n</think>\n\nSure.", "\n\n", "\n\nSure.", QWEN_PLAIN),
    Case("empty_block", "<think></think>Sure.", None, "Sure.", QWEN_PLAIN),
    Case("leading_whitespace_before_start", "\n <think>x</think>y", "x", "y", QWEN_PLAIN),
    Case("ends_at_end_marker", "<think>all thought</think>", "all thought", None, QWEN_PLAIN),
    Case("stray_start_inside_reasoning", "a<think>b</think>c", "ab", "c", QWEN_OPEN),
    Case("content_keeps_later_tags", "<think>r</think>Say </think> or <think>.", "r",
         "Say </think> or <think>.", QWEN_PLAIN, markers_in_content=True),
    Case("unicode", "<think>\nПривет, 世界! e\u0301 👩\u200d💻 <tag>\n</think>\n\nRéponse: ✓ 🎉",
         "\nПривет, 世界! e\u0301 👩\u200d💻 <tag>\n", "\n\nRéponse: ✓ 🎉", QWEN_PLAIN),
    Case("lt_signs_in_reasoning", "if a < b and c <= d </ div>\n</think>\nok",
         "if a < b and c <= d </ div>\n", "\nok", QWEN_OPEN),
    Case("empty_output", "", None, None, QWEN_OPEN),
]

DEEPSEEK_R1 = [
    Case("template_opened_block", "Okay, so the user wants 2+2.\nThat's 4.\n</think>\n\nThe answer is **4**.",
         "Okay, so the user wants 2+2.\nThat's 4.\n", "\n\nThe answer is **4**.", R1_OPEN),
    Case("model_writes_start", "<think>\nHmm, 4.\n</think>\n\nFour.", "\nHmm, 4.\n", "\n\nFour.", R1_PLAIN),
    Case("no_end_is_all_reasoning", "Still thinking about this", "Still thinking about this", None, R1_OPEN),
    Case("no_end_unknown_prompt", "Still thinking", "Still thinking", None),
    Case("end_without_start_unknown_prompt", "abc</think>def", "abc", "def"),
    Case("closed_in_prompt_is_content", "Four.", None, "Four.", R1_CLOSED),
    Case("empty_reasoning", "</think>\n\nHi", None, "\n\nHi", R1_OPEN),
    Case("ends_at_end_marker", "r</think>", "r", None, R1_OPEN),
    Case("unicode", "考虑一下… 🤔\n</think>\n\n答案是 4 ✅", "考虑一下… 🤔\n", "\n\n答案是 4 ✅", R1_OPEN),
    Case("content_keeps_later_tags", "r</think>a </think> b", "r", "a </think> b", R1_OPEN,
         markers_in_content=True),
    Case("empty_output", "", None, None, R1_OPEN),
]

GRANITE = [
    Case("granite32", "Here is my thought process:\n1. The user asks 2+2.\n2. It is 4.\n\nHere is my response:\n"
         "2 + 2 = 4.", "\n1. The user asks 2+2.\n2. It is 4.\n\n", "\n2 + 2 = 4."),
    Case("vllm_no_spaces", "Here is my thought process:This is a reasoning sectionHere is my response:"
         "This is the rest", "This is a reasoning section", "This is the rest"),
    Case("heres_variants", "Here's my thought process: a Here's my response: b", " a ", " b"),
    Case("mixed_variants", "Here's my thought process: a\nHere is my response: b", " a\n", " b"),
    Case("no_reasoning", "Hello, I am Granite.", None, "Hello, I am Granite."),
    Case("content_starting_like_marker", "Here is a poem:\nRoses.", None, "Here is a poem:\nRoses."),
    Case("content_heres_my", "Here's my answer: 4", None, "Here's my answer: 4"),
    Case("truncated_reasoning", "Here is my thought process:\nLet me", "\nLet me", None),
    Case("truncated_mid_response_phrase", "Here is my thought process: x Here is my resp",
         " x Here is my resp", None),
    Case("reasoning_mentions_here", "Here is my thought process: Here is what I know. Here is my response: ok",
         " Here is what I know. ", " ok"),
    Case("empty_reasoning", "Here is my thought process:Here is my response: hi", None, " hi"),
    Case("ends_at_response_phrase", "Here is my thought process: r\nHere is my response:", " r\n", None),
    Case("response_phrase_only", "Here is my response: hi", None, " hi"),
    Case("leading_whitespace", "\n\nHere is my thought process: a Here is my response: b", " a ", " b"),
    Case("text_before_phrase_is_content", "Sure. Here is my thought process: a Here is my response: b", None,
         "Sure. Here is my thought process: a Here is my response: b", markers_in_content=True),
    Case("content_keeps_later_phrases",
         "Here is my thought process: a Here is my response: b Here is my response:",
         " a ", " b Here is my response:", markers_in_content=True),
    Case("granite33_tags", "<think>The user asks 2+2.</think><response>2 + 2 = 4.</response>",
         "The user asks 2+2.", "2 + 2 = 4."),
    Case("granite33_newlines", "<think>\nA\n</think>\n<response>\nB\n</response>", "\nA\n", "\n\nB\n"),
    Case("granite33_truncated", "<think>Thinking abo", "Thinking abo", None),
    Case("granite33_response_only", "<response>Just this.</response>", None, "Just this."),
    Case("unicode", "Here is my thought process:\nΔ = b² − 4ac 🤓\nHere is my response:\nΔ < 0 ⇒ 无实根",
         "\nΔ = b² − 4ac 🤓\n", "\nΔ < 0 ⇒ 无实根"),
    Case("empty_output", "", None, None),
]

CASES = {"qwen3": (QWEN3, THINK_MARKERS), "deepseek_r1": (DEEPSEEK_R1, THINK_MARKERS),
         "granite": (GRANITE, GRANITE_MARKERS)}
