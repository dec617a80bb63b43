"""A small byte-level BPE tokenizer with a Granite-style chat template, built in code.

Deterministic: the same corpus and trainer settings give the same vocabulary. The
special tokens are Granite's (`<|start_of_role|>`, `<|end_of_role|>`,
`<|end_of_text|>`), so prompts and invocation strings look like real intrinsics
prompts. Byte-level BPE means any text (including multi-byte characters)
round-trips.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]

GRANITE_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set system_message = 'You are a helpful assistant.' %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "<|start_of_role|>system<|end_of_role|>{{ system_message }}<|end_of_text|>{{ '\\n' }}"
    "{%- if documents %}{%- for document in documents %}"
    "<|start_of_role|>document {\"document_id\": \"{{ document['doc_id'] | default(loop.index0) }}\"}<|end_of_role|>\n"
    "{{ document['text'] }}<|end_of_text|>{{ '\\n' }}"
    "{%- endfor %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "<|start_of_role|>{{ message['role'] }}<|end_of_role|>{{ message['content'] }}<|end_of_text|>{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{%- endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "How certain are you about that answer? I am fairly certain.",
    "Please answer the question using the documents provided.",
    "system user assistant certainty answerability document hallucination query rewrite",
    "Knowledge Cutoff Date: April 2024. You are a helpful assistant developed for tests.",
    "one two three four five six seven eight nine ten eleven twelve 0 1 2 3 4 5 6 7 8 9 42",
    "Héllo wörld, café naïve façade. 日本語のテキスト。 Ελληνικά. Привет мир. emoji ✓ ★ 🙂",
    "{\"answer\": true, \"score\": 7, \"label\": \"answerable\"} [1, 2, 3] <r0> <c1>",
    "Large language models generate text one token at a time from a key value cache.",
]


def build_tokenizer(vocab_size: int = 1024, corpus: list[str] = _CORPUS, special_tokens: list[str] = SPECIAL_TOKENS,
                    chat_template: str = GRANITE_CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """`special_tokens[0]` is EOS (also BOS and pad); the rest are additional special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=special_tokens[0],
        bos_token=special_tokens[0],
        pad_token=special_tokens[0],
        additional_special_tokens=special_tokens[1:],
    )
    hf_tok.chat_template = chat_template
    return hf_tok


def save_tokenizer(path: str, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    tok.save_pretrained(path)
    return tok
