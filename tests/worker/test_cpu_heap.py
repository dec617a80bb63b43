"""platforms.keep_cpu_heap: a CPU engine's process serves blocks of up to 32 MB from glibc's heap
(a prefill's activations, reused instead of mapped and faulted in afresh each layer), its worker
processes get the same through glibc's environment variables, and a value the user set wins. Each
case runs in a fresh interpreter: glibc reads its variables at start and mallopt lasts a process."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                reason="glibc's allocator settings")

# Bytes glibc holds in mmapped blocks (mallinfo2's hblkhd) around a 16 MB tensor's allocation.
PROBE = """
import ctypes, json, os, sys
import torch
from vllm import platforms

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
kept = platforms.keep_cpu_heap() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblkhd
block = torch.empty(16 << 20, dtype=torch.uint8)
mapped = libc.mallinfo2().hblkhd - before
print(json.dumps({"kept": kept, "mapped": mapped, "mmap": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                  "trim": os.environ.get("MALLOC_TRIM_THRESHOLD_")}))
"""


def probe(mode: str, **env: str) -> dict:
    import json

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                            env={**clean, "THP_MEM_ALLOC_ENABLE": "0", **env})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_16_mb_block_comes_from_the_heap_once_kept():
    from vllm.platforms import CPU_HEAP_MMAP_THRESHOLD, CPU_HEAP_TRIM_THRESHOLD

    assert probe("default")["mapped"] >= 16 << 20, "glibc's default maps a block this large on its own"
    kept = probe("keep")
    assert kept["kept"] is True
    assert kept["mapped"] == 0, "served from the heap"
    assert (kept["mmap"], kept["trim"]) == (str(CPU_HEAP_MMAP_THRESHOLD), str(CPU_HEAP_TRIM_THRESHOLD))


def test_worker_processes_read_the_settings_at_their_start():
    from vllm.platforms import CPU_HEAP_MMAP_THRESHOLD, CPU_HEAP_TRIM_THRESHOLD

    child = probe("default", MALLOC_MMAP_THRESHOLD_=str(CPU_HEAP_MMAP_THRESHOLD),
                  MALLOC_TRIM_THRESHOLD_=str(CPU_HEAP_TRIM_THRESHOLD))
    assert child["mapped"] == 0


def test_a_value_the_user_set_wins():
    user = probe("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert user["kept"] is False
    assert user["trim"] == "131072" and user["mmap"] is None
    assert user["mapped"] >= 16 << 20, "the user's settings, glibc's default threshold"
