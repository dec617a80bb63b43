"""Native CPU attention: sequences with at most MAX_QUERY_LEN query tokens (decodes, an
aLoRA's few tokens over a long cached conversation, small chunks) run the C++ kernel of
csrc/cpu/paged_attention.cpp, which reads keys and values in place from the paged KV
cache; longer prefills run the torch reference (SDPA). Same signature and semantics as
vllm/attention/backends/torch_ref.py, which stays the reference and the test oracle.

Why: torch_ref gathers every block it reads into a contiguous copy and builds a mask
before SDPA; with few query rows over a long context that copy and mask cost more than
the attention itself. The kernel skips both.

Invariants:
  - The kernel is built on first use (the first Attention layer of an engine on CPU, never
    at `import vllm`) with torch's JIT extension builder, for this CPU (-march=native), and
    cached in torch's extension folder. The module name hashes the source, the compiler
    flags, what -march=native means on this machine and the torch version, so a cached
    build is only ever loaded by the code, CPU and torch it was built for.
  - The build is tried at most once per process. Any failure (no compiler, no ninja, a
    compiler that rejects -march=native, the source not shipped, a compile error) logs one
    warning, `is_available()` stays False and `unavailable_reason()` says why; the engine
    then runs torch_ref. The engine works without the kernel.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import time
from typing import Optional

import torch

import vllm
from vllm import envs
from vllm.attention.backends import torch_ref
from vllm.attention.metadata import AttentionMetadata
from vllm.attention.variant import AttentionVariant
from vllm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__))), "csrc", "cpu",
                       "paged_attention.cpp")
# -fopenmp makes at::parallel_for parallel (its OpenMP body is compiled into the kernel); the
# extension links the libgomp torch already loaded, so torch.set_num_threads applies.
_FLAGS = ["-O3", "-fopenmp", "-march=native"]


def _native_target() -> str:
    """What -march=native means to the compiler here: its predefined macros under the flag,
    which name every instruction set it enables. The kernel is built only for the host's own
    vector units: a generic build measured 1.6x slower than the torch reference, so a compiler
    that rejects the flag means no kernel, not a slow one."""
    probe = [envs.CXX, "-march=native", "-dM", "-E", "-x", "c++", os.devnull]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot run the C++ compiler {envs.CXX!r}: {e}") from e
    if result.returncode != 0:
        raise RuntimeError(f"the C++ compiler {envs.CXX!r} rejects -march=native: {result.stderr.strip()}")
    return result.stdout


def _load() -> None:
    from torch.utils import cpp_extension

    if not os.path.exists(_SOURCE):
        raise FileNotFoundError(f"{_SOURCE} is missing (the kernel source ships with a source checkout only)")
    target = _native_target()
    with open(_SOURCE, "rb") as f:
        key = f.read() + "\0".join([*_FLAGS, target, torch.__version__]).encode()
    name = "vllm_cpu_attention_" + hashlib.sha256(key).hexdigest()[:16]
    cached = os.path.exists(os.path.join(cpp_extension._get_build_directory(name, verbose=False), name + ".so"))
    if not cached:
        logger.info("Building the CPU attention kernel, once (about 10-60 s); later starts load it from cache.")
    start = time.perf_counter()
    cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    if not cached:
        logger.info("Built the CPU attention kernel in %.1f s.", time.perf_counter() - start)


@functools.cache
def unavailable_reason() -> Optional[str]:
    """Builds (first time on this machine) or loads the kernel. None on success, else the
    first line of the error, which is also logged once as a warning."""
    try:
        _load()
    except Exception as e:  # noqa: BLE001 - any failure means "use the torch reference"
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        logger.warning("The native CPU attention kernel is unavailable, using the torch reference ops: %s", reason)
        logger.debug("Native CPU attention kernel failure in full:", exc_info=True)
        return reason
    return None


def is_available() -> bool:
    return unavailable_reason() is None


# Query tokens up to which a sequence runs the kernel rather than SDPA. Measured on a 2-core
# AVX-512 machine (fp32, 9 query / 3 KV heads of 64, over a 2k-token context): the kernel
# takes 0.35x torch_ref's time at 4 query tokens, 0.55x at 20, 0.8x at 128, 0.95x at 512, and
# loses at 1024, where SDPA's blocked GEMMs catch up.
MAX_QUERY_LEN = 512


def paged_attention_rows(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                         scale: float) -> None:
    """out rows of every sequence with at most `max_query_len` query tokens (others are not
    written): sequence i's tokens query_start_loc[i]:query_start_loc[i+1] are its newest, on
    top of seq_lens[i] - their count cached positions, attending causally. out, query:
    [num_tokens, H, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; block_table:
    [>= num_seqs, max_blocks], seq_lens: [num_seqs], query_start_loc: [num_seqs + 1], all int32.
    Call is_available() first."""
    torch.ops.vllm_cpu.paged_attention(out, query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
                                       scale)


def _short_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, variant: AttentionVariant) -> int:
    if not variant.is_plain:  # the kernel computes plain causal attention only
        return torch_ref.decode_attention(out, query, kv_cache, meta, scale, variant)
    paged_attention_rows(out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc, MAX_QUERY_LEN,
                         scale)
    return MAX_QUERY_LEN


# torch_ref's paged attention with the short sequences on the native kernel.
paged_attention = functools.partial(torch_ref.paged_attention, short=_short_attention)
