"""KV-cache sizing and allocation.

Capacity, in order of precedence: `num_gpu_blocks_override`, `kv_cache_memory_bytes`,
then per device: on CPU `VLLM_CPU_KVCACHE_SPACE` GiB, or by default the smaller of
4 GiB and what `max_num_seqs` sequences of `max_model_len` tokens could ever use; on
CUDA `gpu_memory_utilization` of the device minus the peak of a profiling forward
pass. The caches are allocated uninitialised (no start-up cost, memory grows with
use) and every block is zeroed when the scheduler hands it out fresh
(`zero_blocks`): the torch attention reads whole blocks and masks positions past a
sequence's end with zero weights, and 0 * NaN would poison the output.

Under tensor parallelism every rank holds the same blocks for its own KV heads
(`kv_heads_per_rank`): sizes here are one rank's, and all ranks get the same block count.
"""

from __future__ import annotations

from typing import Callable

import torch

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig
from vllm.core.kv_cache_utils import cdiv
from vllm.distributed.parallel_state import get_tp
from vllm.logger import init_logger
from vllm.model_executor.layers.tensor_parallel import kv_heads_per_rank
from vllm.worker import huge_pages

logger = init_logger(__name__)

_DEFAULT_CPU_BYTES = 4 << 30


def _num_kv_heads(model_config: ModelConfig) -> int:
    return kv_heads_per_rank(model_config.num_kv_heads, get_tp().world_size)


def bytes_per_block(model_config: ModelConfig, cache_config: CacheConfig) -> int:
    """One block's bytes over every layer, on one rank, in the cache's dtype."""
    element = torch.tensor([], dtype=cache_config.kv_dtype(model_config.dtype)).element_size()
    return (2 * model_config.num_layers * cache_config.block_size * _num_kv_heads(model_config)
            * model_config.head_size * element)


def determine_num_blocks(
    cache_config: CacheConfig,
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    profile_peak_bytes: Callable[[], int],
) -> int:
    """`profile_peak_bytes` runs a worst-case forward pass and returns the peak memory
    it used (only called on CUDA when no explicit size is given)."""
    per_block = bytes_per_block(model_config, cache_config)
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    if cache_config.kv_cache_memory_bytes is not None:
        return _at_least_one(cache_config.kv_cache_memory_bytes // per_block, "kv_cache_memory_bytes")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * cache_config.gpu_memory_utilization) - profile_peak_bytes()
        logger.info("KV cache gets %.2f GiB (gpu_memory_utilization=%.2f)", budget / 2**30,
                    cache_config.gpu_memory_utilization)
        return _at_least_one(budget // per_block, "gpu_memory_utilization")
    if cache_config.cpu_kvcache_space_bytes is not None:
        return _at_least_one(cache_config.cpu_kvcache_space_bytes // per_block, "VLLM_CPU_KVCACHE_SPACE")
    useful = scheduler_config.max_num_seqs * cdiv(scheduler_config.max_model_len, cache_config.block_size)
    return max(1, min(_DEFAULT_CPU_BYTES // per_block, useful))


def _at_least_one(num_blocks: int, source: str) -> int:
    if num_blocks < 1:
        raise ValueError(f"No room for a single KV-cache block with the memory given by {source}; increase it.")
    return int(num_blocks)


def allocate_kv_caches(model_config: ModelConfig, cache_config: CacheConfig, num_blocks: int,
                       device: torch.device) -> list[torch.Tensor]:
    """One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_size], in the cache's dtype.

    Zeroed, not empty: on the CPU that touches every page now, so the cache is resident from
    start-up (a cache too large for the machine fails here, not hours later) and the server's
    memory does not creep up as the free-block queue rotates through blocks never used before.
    On the CPU the layers share one arena on transparent huge pages where the kernel grants them
    (huge_pages.py): fewer TLB misses as attention reads blocks wherever the block table points."""
    shape = (2, num_blocks, cache_config.block_size, _num_kv_heads(model_config), model_config.head_size)
    dtype = cache_config.kv_dtype(model_config.dtype)
    if device.type == "cpu":  # on transparent huge pages where the kernel grants them (huge_pages.py)
        caches = huge_pages.zeros(shape, dtype, model_config.num_layers)
        if caches is not None:
            return caches
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)]


def zero_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> None:
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for cache in kv_caches:
        cache.index_fill_(1, index, 0)
