"""Prompt forms accepted by `LLM.generate` and `LLMEngine.add_request` (vLLM's names).

A prompt is a string, a `TextPrompt` ({"prompt": str}) or a `TokensPrompt`
({"prompt_token_ids": [...]}); either dict may carry `cache_salt`.
"""

from __future__ import annotations

from typing import Optional, Union

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]


def lone_surrogate(text: str) -> Optional[str]:
    """Where `text` holds a lone surrogate (JSON's `\\ud800` escapes decode to them; no
    tokenizer can encode one), as words for an error message; None for valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"lone surrogate {text[e.start]!r} at index {e.start}"
    return None
