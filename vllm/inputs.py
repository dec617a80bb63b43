"""Prompt forms accepted by `LLM.generate` and `LLMEngine.add_request` (vLLM's names).

A prompt is a string, a `TextPrompt` ({"prompt": str}) or a `TokensPrompt`
({"prompt_token_ids": [...]}); either dict may carry `cache_salt`.
"""

from __future__ import annotations

from typing import Union

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]
