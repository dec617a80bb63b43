"""Test helper: the messages a `vllm` logger emits inside a block. The `vllm` logger does not
propagate to the root logger (vllm/logger.py), so pytest's caplog never sees them."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


class _Messages(logging.Handler):
    def __init__(self, level: int):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def logged_messages(logger_name: str, level: int = logging.INFO) -> Iterator[list[str]]:
    """Yields the list that collects the formatted messages of `logger_name` at `level` and above."""
    handler, logger = _Messages(level), logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
