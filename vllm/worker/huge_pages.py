"""Model weights and the KV cache on transparent huge pages (CPU).

Why: a decode step streams every weight once and reads the KV of every sequence in it. On 4 KB
pages that is a page walk every 4 KB, and the hardware prefetchers stop at each page's end.
Linux backs anonymous memory with 2 MB pages where the memory is advised so (MADV_HUGEPAGE) and
its THP mode is "madvise" (Ubuntu's default) or "always". torch's allocator advises only blocks
of 2 MB or more, and only if THP_MEM_ALLOC_ENABLE was set before its first allocation (CPU
engines set it: platforms.use_cpu_huge_pages), so a small model's layers (0.6-1.8 MB each on
SmolLM2-135M) stayed on 4 KB pages, and so did everything of an engine built in a process that
had allocated before. Measured on a Zen 3 EPYC, one thread, SmolLM2's bf16 weights beyond
cache: a plain read 20-25% faster on 2 MB pages, its dense GEMVs 10-20%; in the engine see
docs/benchmarks.md.

What it owns:
  - `Arena`: one private anonymous mapping advised MADV_HUGEPAGE, its start 2 MB aligned, carved
    into 64-byte aligned pieces.
  - `move_to_huge_pages(tensors)`: the bytes the tensors span, storage by storage, copied into one
    arena, and every tensor re-pointed there in place (`Tensor.set_`).
  - `zeros(shape, dtype, count)`: `count` zeroed tensors carved from one arena (the KV cache).

Invariants:
  - Values are bitwise unchanged. A moved tensor keeps its identity (the object that modules,
    lists and the native decode stacks hold), dtype, shape and strides; tensors that shared a
    storage share the arena's, at the same distances.
  - Only CPU tensors with a strided layout and at least one element move; others stay as they are.
  - Where huge pages are unavailable (THP "never", not Linux, THP_MEM_ALLOC_ENABLE=0) nothing
    moves and `zeros` returns None: callers keep torch's allocation.
  - The mapping lives as long as any tensor on it: the arena's storage holds the buffer.
"""

from __future__ import annotations

import functools
import mmap
from typing import Iterable, Optional

import torch

from vllm import envs

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: a cache line, and every dtype's element size divides it
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def thp_mode() -> Optional[str]:
    """The kernel's THP mode ("always", "madvise", "never"), or None where it cannot be read."""
    try:
        with open(THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def available() -> bool:
    """Whether tensors here may go on huge pages (the module docstring's conditions)."""
    return (envs.THP_MEM_ALLOC_ENABLE and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")
            and thp_mode() in ("always", "madvise"))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """`nbytes` of anonymous memory on huge pages, as one uint8 storage; `take` hands out pieces."""

    def __init__(self, nbytes: int):
        # Whole huge pages from the first 2 MB boundary on: the kernel maps a huge page only where
        # its whole 2 MB lie inside the mapping. Private: a shared anonymous mapping is shmem,
        # which THP's "enabled" mode does not cover.
        pages = -(-nbytes // HUGE_PAGE)
        buffer = mmap.mmap(-1, (pages + 1) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(buffer, dtype=torch.uint8)  # the whole mapping; keeps it alive
        self.storage = self.bytes.untyped_storage()
        self.offset = (-self.bytes.data_ptr()) % HUGE_PAGE  # the first 2 MB boundary
        self.end = self.offset + nbytes

    def take(self, nbytes: int) -> int:
        """The byte offset (in `storage`) of a fresh 64-byte aligned piece of `nbytes`."""
        start = self.offset
        if start + nbytes > self.end:
            raise ValueError(f"arena exhausted: {nbytes} bytes asked, {self.end - start} left")
        self.offset = start + _aligned(nbytes)
        return start


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of t's storage that t's elements occupy, the first rounded down to
    ALIGN (so a piece keeps every tensor's offset modulo ALIGN, hence its element alignment)."""
    size = t.element_size()
    first = t.storage_offset() * size
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return first - first % ALIGN, first + extent * size


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move `tensors` (duplicates and views welcome) onto one arena in place; returns the bytes
    moved (0 where huge pages are unavailable or nothing qualifies)."""
    if not available():
        return 0
    groups: dict[int, list[torch.Tensor]] = {}  # storage address -> its tensors
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen or not _movable(t):
            continue
        seen.add(id(t))
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    spans = {key: (min(_span(t)[0] for t in ts), max(_span(t)[1] for t in ts)) for key, ts in groups.items()}
    total = sum(_aligned(end - first) for first, end in spans.values())
    if total == 0:
        return 0
    arena = Arena(total)
    with torch.inference_mode():  # set_ on tensors made in inference mode as well as outside it
        for key in sorted(groups):  # address order: neighbours in memory stay neighbours
            first, end = spans[key]
            old = torch.empty(0, dtype=torch.uint8).set_(groups[key][0].untyped_storage())
            start = arena.take(end - first)
            arena.bytes[start:start + end - first].copy_(old[first:end])
            for t in groups[key]:
                offset = start + t.storage_offset() * t.element_size() - first
                t.set_(arena.storage, offset // t.element_size(), t.shape, t.stride())
    return total


def zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> Optional[list[torch.Tensor]]:
    """`count` contiguous zeroed tensors of `shape` on one arena (every page touched now), or
    None where huge pages are unavailable."""
    if not available():
        return None
    each = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    arena = Arena(_aligned(each) * count)
    out = []
    for _ in range(count):
        start = arena.take(each)
        out.append(arena.bytes[start:start + each].view(dtype).view(shape).zero_())
    return out
