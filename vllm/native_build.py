"""Builds and loads the C++ kernels of vllm/csrc/cpu/ on first use, with torch's JIT extension
builder, for this CPU (-march=native), cached in torch's extension folder. The sources are
package data: every install (a source checkout, `pip install .`, a wheel) carries them.

Invariants:
  - A build is keyed by a hash of the source and the folder's headers, the compiler flags,
    what -march=native means on this machine and the torch version: a cached build is only
    ever loaded by the code, CPU and torch it was built for.
  - A build lock older than STALE_LOCK_S (a build interrupted by a killed process) is removed
    rather than waited on forever.
  - Each source is tried at most once per process. Any failure (no compiler, no ninja, a
    compiler that rejects -march=native, the source not shipped, a compile error) logs one
    warning and `unavailable_reason(source)` says why; callers then use their torch path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import subprocess
import time
from typing import Optional

import torch

import vllm
from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)

CSRC_CPU = os.path.join(os.path.dirname(os.path.abspath(vllm.__file__)), "csrc", "cpu")
# -fopenmp makes at::parallel_for parallel (its OpenMP body is compiled into the kernel) and
# enables `omp simd`; the extension links the libgomp torch already loaded, so
# torch.set_num_threads applies.
FLAGS = ["-O3", "-fopenmp", "-march=native"]
STALE_LOCK_S = 900  # a build lock this old (seconds) belongs to an interrupted build


@functools.cache
def native_target() -> str:
    """What -march=native means to the compiler here: its predefined macros under the flag,
    which name every instruction set it enables. Kernels are built only for the host's own
    vector units: a compiler that rejects the flag means no kernel, not a slow one."""
    probe = [envs.CXX, "-march=native", "-dM", "-E", "-x", "c++", os.devnull]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot run the C++ compiler {envs.CXX!r}: {e}") from e
    if result.returncode != 0:
        raise RuntimeError(f"the C++ compiler {envs.CXX!r} rejects -march=native: {result.stderr.strip()}")
    return result.stdout


def _headers() -> bytes:
    """The folder's shared headers (bf16_bits.h ...), part of every build's key: a kernel that
    includes one is rebuilt when it changes."""
    return b"".join(path.read_bytes() for path in sorted(pathlib.Path(CSRC_CPU).glob("*.h")))


def build_name(source: str, folder: str = CSRC_CPU) -> str:
    """The extension's name: the source's stem and a hash of everything the build depends on."""
    path = os.path.join(folder, source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing (an install without vllm's package data)")
    with open(path, "rb") as f:
        key = f.read() + _headers() + "\0".join([*FLAGS, native_target(), torch.__version__]).encode()
    return f"vllm_{os.path.splitext(source)[0]}_" + hashlib.sha256(key).hexdigest()[:16]


def _clear_stale_lock(build_dir: str) -> None:
    """torch's extension builder waits, without a timeout, for the lock file of a build that
    another process started; a process killed mid-build (an engine stopped during its first
    start) leaves the file behind and every later start would hang on it. A build takes a
    minute at most, so a lock older than STALE_LOCK_S is an orphan: removed, with a warning."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock
    if age > STALE_LOCK_S:
        logger.warning("Removing the stale build lock %s (%.0f s old: its build was interrupted).", lock, age)
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)


def build_and_load(source: str, what: str, folder: str = CSRC_CPU) -> None:
    """Compile (or load from cache) `folder`/`source` (vllm/csrc/cpu/ unless a benchmark builds
    its own), which registers its torch ops."""
    from torch.utils import cpp_extension

    name = build_name(source, folder)
    path = os.path.join(folder, source)
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    _clear_stale_lock(build_dir)
    cached = os.path.exists(os.path.join(build_dir, name + ".so"))
    if not cached:
        logger.info("Building the %s, once (about 10-60 s); later starts load it from cache.", what)
    start = time.perf_counter()
    cpp_extension.load(name=name, sources=[path], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    if not cached:
        logger.info("Built the %s in %.1f s.", what, time.perf_counter() - start)


@functools.cache
def unavailable_reason(source: str, what: str) -> Optional[str]:
    """Builds or loads the kernel once per process. None on success, else the first line of
    the error, which is also logged once as a warning."""
    try:
        build_and_load(source, what)
    except Exception as e:  # noqa: BLE001 - any failure means "use the torch path"
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        logger.warning("The native %s is unavailable, using the torch path: %s", what, reason)
        logger.debug("Native %s failure in full:", what, exc_info=True)
        return reason
    return None
