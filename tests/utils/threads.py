"""Running a computation at several torch thread counts (for kernels whose results must not
depend on them), restoring the process's thread count afterwards."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def on_thread_counts(fn: Callable[[], T], counts: tuple[int, ...] = (1, 2)) -> list[T]:
    """fn()'s result at each of `counts` torch threads, in that order."""
    threads = torch.get_num_threads()
    try:
        results = []
        for count in counts:
            torch.set_num_threads(count)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)
