"""Every environment variable the engine reads, read here and nowhere else.

Values are read when accessed (module attribute lookup), so tests and the CLI can
set them before use.
"""

import os
from typing import Any, Callable, Optional


def _bool(name: str, default: bool = False) -> Callable[[], bool]:
    def read() -> bool:
        value = os.environ.get(name)
        if value is None:
            return default
        return value.strip().lower() in ("1", "true", "yes", "on")

    return read


def _float_or_none(name: str) -> Callable[[], Optional[float]]:
    def read() -> Optional[float]:
        value = os.environ.get(name)
        return float(value) if value not in (None, "") else None

    return read


def _str(name: str, default: Optional[str] = None) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name, default)


_VARIABLES: dict[str, Callable[[], Any]] = {
    # KV cache size on CPU, in GiB (vLLM's name).
    "VLLM_CPU_KVCACHE_SPACE": _float_or_none("VLLM_CPU_KVCACHE_SPACE"),
    # Enables /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's name).
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": _bool("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
    # Force the torch reference ops: no Triton on a GPU, no oneDNN linears or native
    # attention kernel on the CPU (debugging, oracles).
    "VLLM_USE_TORCH_REFERENCE_OPS": _bool("VLLM_USE_TORCH_REFERENCE_OPS"),
    # OpenMP's thread count: when set, the default of --cpu-threads (torch reads it too).
    "OMP_NUM_THREADS": _str("OMP_NUM_THREADS"),
    # C++ compiler of torch's extension builder (its name), probed before building the
    # native CPU attention kernel.
    "CXX": _str("CXX", "c++"),
    # Refuse network access to the model hub.
    "HF_HUB_OFFLINE": _bool("HF_HUB_OFFLINE"),
    # Where converted models (the default model) are cached.
    "VLLM_CACHE_ROOT": _str(
        "VLLM_CACHE_ROOT",
        os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm"),
    ),
    # Logging level of the `vllm` logger.
    "VLLM_LOGGING_LEVEL": _str("VLLM_LOGGING_LEVEL", "INFO"),
    # Folder for torch profiler traces of LLM.start_profile()/stop_profile(); unset, profiling
    # is refused (vLLM's name).
    "VLLM_TORCH_PROFILER_DIR": _str("VLLM_TORCH_PROFILER_DIR"),
    # API key for the server when --api-key is not given (vLLM's name).
    "VLLM_API_KEY": _str("VLLM_API_KEY"),
    # CPU tensor parallelism: cores per rank, "0-3|4-7" (rank 0 on 0-3, rank 1 on 4-7; vLLM's name).
    # Unset: ranks share the process's cores, --cpu-threads each.
    "VLLM_CPU_OMP_THREADS_BIND": _str("VLLM_CPU_OMP_THREADS_BIND"),
    # Seconds a tensor-parallel collective may wait for a peer before the engine is declared dead
    # (a hung rank); a rank that exits is noticed at once.
    "VLLM_TP_TIMEOUT_S": _float_or_none("VLLM_TP_TIMEOUT_S"),
    # torch's switch for transparent huge pages under its CPU allocator (blocks of 2 MB and up),
    # which CPU engines set to 1 unless the user did (platforms.use_cpu_huge_pages); 0 also keeps
    # the weights and KV cache off the engine's huge-page arenas (vllm/worker/huge_pages.py).
    "THP_MEM_ALLOC_ENABLE": _bool("THP_MEM_ALLOC_ENABLE", default=True),
    # glibc's own malloc settings, read by glibc at a process's start; CPU engines set both unless the
    # user set either (platforms.keep_cpu_heap).
    "MALLOC_MMAP_THRESHOLD_": _str("MALLOC_MMAP_THRESHOLD_"),
    "MALLOC_TRIM_THRESHOLD_": _str("MALLOC_TRIM_THRESHOLD_"),
    # Test-only fault injection, e.g. "step=3,tokenizer=BOOM" (see vllm/fault_injection.py).
    "VLLM_FAULT_INJECTION": _str("VLLM_FAULT_INJECTION"),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module 'vllm.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(_VARIABLES)
