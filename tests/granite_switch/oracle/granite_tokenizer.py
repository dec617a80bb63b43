"""A tiny Granite-4-style tokenizer and chat template, built in code (oracle venv side).

Owns the byte-level BPE vocabulary (built by tests/utils/tokenizer.py, with
Granite's special tokens plus a few `<|unused_N|>` reserved slots) and a chat
template shaped like Granite 4.1's: one `ns = namespace(...)`, a `messages[0]`
system check, a main `for message in messages` loop whose body assembles
`content.val` before the `(message.role == 'user') or` branch, role markers
emitted as single-quoted literals, and a separate `add_generation_prompt` block.
Those are exactly the anchors granite-switch's composer rewrites to place control
tokens, so composition succeeds on this tiny tokenizer.
"""

from __future__ import annotations

import os
import sys

from transformers import PreTrainedTokenizerFast

# The repository root, so the shared tokenizer builder imports in the oracle venv too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from tests.utils.tokenizer import build_tokenizer as build_test_tokenizer  # noqa: E402

START, END, EOT = "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"
UNUSED = [f"<|unused_{i}|>" for i in range(4)]
SPECIAL_TOKENS = [EOT, START, END, "<|tool_call|>", *UNUSED]

# Jinja source. Keep every role marker inside a single-quoted literal that starts
# with the marker (the composer's skip-once rewrite matches those), keep `)` out of
# the namespace arguments, and iterate `messages` (not a sliced copy) in the loop.
GRANITE_CHAT_TEMPLATE = """{%- set ns = namespace(system_message='You are a helpful assistant.', first_is_system=false) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.first_is_system = true %}
{%- else %}
    {{- '<|start_of_role|>system<|end_of_role|>' + ns.system_message + '<|end_of_text|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = namespace(val='') %}
    {%- if message.content is string %}
        {%- set content.val = message.content %}
    {%- elif message.content is iterable %}
        {%- for entry in message.content %}
            {%- if entry.type == 'text' %}
                {%- if content.val != '' %}
                    {%- set content.val = content.val + '\\n' %}
                {%- endif %}
                {%- set content.val = content.val + entry.text %}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {%- if (message.role == 'user') or (message.role == 'system') %}
        {{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + content.val + '<|end_of_text|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' + content.val + '<|end_of_text|>\\n' }}
    {%- else %}
        {{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + content.val + '<|end_of_text|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_of_role|>assistant<|end_of_role|>' }}
{%- endif %}"""

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Is this request safe? Please check the last message for harm.",
    "Rewrite the last question so it stands alone without the conversation.",
    "Please answer the question using the documents provided, with citations.",
    "system user assistant guardian rewrite citation answer question document",
    "You are a helpful assistant. Knowledge Cutoff Date: April 2024.",
    "one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9 42",
    "{\"score\": 7, \"label\": \"safe\"} [1, 2, 3] <guardian> <rewrite> yes no",
    "Large language models generate text one token at a time from a key value cache.",
]


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """The shared test BPE (tests/utils/tokenizer.py) on this corpus, tokens and template;
    `len(tok)` is the full vocab."""
    return build_test_tokenizer(vocab_size, _CORPUS, SPECIAL_TOKENS, GRANITE_CHAT_TEMPLATE)
