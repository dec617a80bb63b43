"""The one place that knows which device we run on and what that implies.

`current_platform()` picks CUDA when available, else CPU. Kernels are chosen with
`use_triton_kernels()`: Triton on CUDA (unless VLLM_USE_TORCH_REFERENCE_OPS is set),
torch reference ops everywhere else, except where a CPU op has a native or oneDNN path
(`use_onednn_linear()`, `use_native_cpu_attention()`).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Optional

import torch

from vllm import envs


@dataclass(frozen=True)
class Platform:
    device_type: str  # "cuda" | "cpu"
    default_dtype: torch.dtype  # what dtype="auto" gives for an fp32 checkpoint or an unknown one
    native_bf16: bool = True  # bf16 arithmetic in hardware (CPU: AVX512-BF16 or AMX)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def auto_dtype(self, checkpoint_dtype: Optional[torch.dtype]) -> torch.dtype:
        """dtype="auto": on CUDA bf16; on a CPU with native bf16 the checkpoint's half
        precision as bf16 (fp16 runs as bf16, as vLLM's CPU backend does), else fp32."""
        if self.is_cuda:
            return self.default_dtype
        if self.native_bf16 and checkpoint_dtype in (torch.bfloat16, torch.float16):
            return torch.bfloat16
        return torch.float32


def _cpu_supports(probe: str) -> bool:
    """torch.cpu's private feature probe `probe`, False where this torch lacks it."""
    return getattr(torch.cpu, probe, lambda: False)()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles: without them bf16 matmuls are emulated and slower than fp32."""
    return cpu_has_avx512_bf16() or _cpu_supports("_is_amx_tile_supported")


def cpu_has_avx512_bf16() -> bool:
    """AVX512-BF16 (vdpbf16ps): what the CPU kernels' bf16 dot-product tiles need."""
    return _cpu_supports("_is_avx512_bf16_supported")


def cpu_has_avx512() -> bool:
    """Whether torch's CPU kernels run AVX-512 here (its dispatch capability; ATEN_CPU_CAPABILITY
    lowers it): where the engine's measured CPU choices differ from AVX2 machines."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def use_cpu_huge_pages() -> None:
    """Large CPU tensors (weights, the KV cache) on 2 MB transparent huge pages where the kernel
    gives them on request (THP "madvise", a common default): torch's allocator asks for them once
    THP_MEM_ALLOC_ENABLE is set, a setting it reads at its first allocation, so the engine calls
    this before it allocates anything. Fewer TLB misses on the weights and KV blocks a decode
    streams through: a SmolLM2 bf16 decode step 6-8% faster (AVX-512 EPYC, three alternating runs
    each way), fp32 ~3%, int4 the same. A value the user set wins (0 keeps 4 KB pages). The
    weights (blocks under 2 MB too) and the KV cache go on huge pages through the engine's own
    arenas (vllm/worker/huge_pages.py) whenever torch first allocated; this setting covers the rest."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


# glibc's mallopt parameters (malloc.h) and the values CPU engines give them: the mmap threshold at
# glibc's ceiling on 64-bit, and memory freed at the heap's top kept up to the trim threshold.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
CPU_HEAP_MMAP_THRESHOLD = 32 << 20
CPU_HEAP_TRIM_THRESHOLD = 256 << 20


def keep_cpu_heap() -> bool:
    """A forward's temporaries reused from the heap, not mapped afresh and faulted in again each
    time: glibc serves a block of at least its mmap threshold (dynamic, from 128 KB) with a fresh
    mapping that each free unmaps, and a prefill's activations are MBs to tens of MBs a layer. With
    the threshold at 32 MB and the heap's top kept up to 256 MB, a SmolLM2 bf16 2,048-token prefill
    took 0.98x the time (Zen 4, one thread, alternating runs); the kernel's zeroing and faulting of
    fresh pages had been ~1.5% of it. Both values also go into glibc's environment variables, which
    the engine's worker processes read at their start. A value the user set for either wins. Returns
    whether this call set this process's allocator (False: the variables were already set, by the
    user or an earlier call, or this is not glibc)."""
    if envs.MALLOC_MMAP_THRESHOLD_ is not None or envs.MALLOC_TRIM_THRESHOLD_ is not None:
        return False
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(CPU_HEAP_MMAP_THRESHOLD)
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(CPU_HEAP_TRIM_THRESHOLD)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no glibc (macOS, Windows)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, CPU_HEAP_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, CPU_HEAP_TRIM_THRESHOLD))


def default_cpu_threads() -> int:
    """OMP_NUM_THREADS when set (as torch itself honours it); else the cores this process may
    run on (its affinity mask, which taskset and container cpusets narrow), not the machine's."""
    if (envs.OMP_NUM_THREADS or "").strip().isdigit() and int(envs.OMP_NUM_THREADS) > 0:
        return int(envs.OMP_NUM_THREADS)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        return os.cpu_count() or 1


def current_platform(device: Optional[str] = None) -> Platform:
    """`device` is the user's choice ("auto", "cpu", "cuda"); None means auto."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available; use device='cpu'.")
        return Platform("cuda", torch.bfloat16)
    if device == "cpu":
        return Platform("cpu", torch.float32, native_bf16=cpu_has_native_bf16())
    raise ValueError(f"Unknown device {device!r}; allowed: 'auto', 'cpu', 'cuda'.")


def use_triton_kernels(device: torch.device) -> bool:
    if envs.VLLM_USE_TORCH_REFERENCE_OPS:
        return False
    return device.type == "cuda"


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN can pre-pack and run `dtype` weights on this CPU: half
    precision only where the CPU supports it (bf16: AVX512-BW/VL/DQ or AVX-NE-CONVERT; fp16:
    AVX512-FP16 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    half_supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    if dtype in half_supported and not getattr(torch.ops.mkldnn, half_supported[dtype])():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn_linear(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """CPU linears run on oneDNN with weights pre-packed into its blocked layout where it packs
    the dtype (about 2x faster than MKL's sgemm on the small-M shapes of decoding), except fp32
    and bf16 wherever the native GEMV (layers/dense_gemv.py) is built: their weights then stay
    row-major, the GEMV runs decodes at about the copy bandwidth (it reads only the plain
    layout; bf16 on an AVX-512 EPYC 1.1-1.3x faster than oneDNN's packed weights at 1 and 2 rows)
    and prefills run on the plain weight (`dense_gemv.many_rows_linear`; oneDNN there reads it
    3-9% slower than packed at 128-2,048 rows). Elsewhere F.linear, which stays the reference path."""
    if device.type != "cpu" or envs.VLLM_USE_TORCH_REFERENCE_OPS or not onednn_packs(dtype):
        return False
    from vllm.model_executor.layers import dense_gemv

    return not (dtype in dense_gemv.WEIGHT_DTYPES and dense_gemv.native_available())


def use_native_cpu_attention(device: torch.device) -> bool:
    """CPU attention of decodes and short prefills runs the C++ kernel of
    vllm/csrc/cpu/paged_attention.cpp (about 2x faster than torch_ref's gather + SDPA for a few
    query tokens over a long context); torch_ref stays the reference path. The first call on
    a machine builds the kernel (cached afterwards); False if it cannot be built."""
    if device.type != "cpu" or envs.VLLM_USE_TORCH_REFERENCE_OPS:
        return False
    from vllm.attention.backends import cpu_native

    return cpu_native.is_available()


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def checkpoint_dtype(hf_config) -> Optional[torch.dtype]:
    """The dtype a checkpoint's config says its weights are stored in (None when it says none)."""
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return getattr(torch, stored, None) if isinstance(stored, str) else stored


def resolve_dtype(dtype: str | torch.dtype, platform: Platform,
                  checkpoint_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return platform.auto_dtype(checkpoint_dtype)
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; allowed: 'auto', {', '.join(repr(k) for k in _DTYPES)}.")
    return _DTYPES[dtype]
