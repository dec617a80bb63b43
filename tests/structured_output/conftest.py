"""Fixtures: a structured-output manager over the test tokenizer, with a model vocabulary
padded past the tokenizer's (as real checkpoints often pad lm_head)."""

from __future__ import annotations

import pytest

from vllm.structured_output import StructuredOutputManager

PADDING = 11


@pytest.fixture(scope="session")
def vocab_size(tokenizer) -> int:
    return len(tokenizer) + PADDING


@pytest.fixture(scope="session")
def manager(tokenizer, vocab_size) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, vocab_size)


@pytest.fixture
def fresh_manager(tokenizer, vocab_size):
    """A manager with an empty cache, for tests that count compiles."""
    return lambda **kwargs: StructuredOutputManager(tokenizer, vocab_size, **kwargs)
