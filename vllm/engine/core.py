"""`EngineCore`: the step loop's body: schedule -> execute -> update.

It owns the model runner (or, with tensor parallelism, the executor that runs one runner
per rank: vllm/executor/multiproc.py), the scheduler and the step profiler, sizes the KV
cache at start-up, and exposes statistics. It never sees text: requests arrive tokenised and validated.
Invariant: `max_model_len` tokens of one sequence always fit in the KV cache, so a
lone request can never be stuck waiting for blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch

from vllm.config import VllmConfig
from vllm.core.kv_cache_utils import cdiv
from vllm.core.request import Request, RequestStatus
from vllm.core.sched_output import EngineCoreOutput
from vllm.core.scheduler import Scheduler
from vllm.engine.profiler import StepProfiler
from vllm.logger import init_logger
from vllm.worker.kv_cache import bytes_per_block, determine_num_blocks
from vllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    alora_reused_tokens: int
    num_preemptions: int
    prompt_tokens: int = 0  # prompt tokens of requests that produced a first token (each n > 1 child counts)
    generation_tokens: int = 0  # tokens sampled
    # Adapter names of running / waiting requests, and max_loras (0: LoRA off): vllm:lora_requests_info.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    num_free_blocks: int = 0  # KV blocks no request holds (cached ones included: they can be evicted)


class EngineCore:
    def __init__(self, vllm_config: VllmConfig, structured_output_manager=None):
        self.config = vllm_config
        torch.manual_seed(vllm_config.model_config.seed)
        started = time.time()
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            from vllm.executor.multiproc import MultiprocExecutor

            self.runner = MultiprocExecutor(vllm_config)
        else:
            self.runner = ModelRunner(vllm_config)
        self.runner.load_model()
        model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
        num_blocks = determine_num_blocks(
            cache_config, model_config, vllm_config.scheduler_config, vllm_config.device_config.device,
            self.runner.profile_peak_bytes,
        )
        capacity = num_blocks * cache_config.block_size
        if capacity < model_config.max_model_len:
            raise ValueError(
                f"The KV cache holds {capacity} tokens ({num_blocks} blocks of {cache_config.block_size}), fewer than "
                f"max_model_len={model_config.max_model_len}: one long request could never run. Give the cache more "
                "memory (kv_cache_memory_bytes, VLLM_CPU_KVCACHE_SPACE, gpu_memory_utilization or "
                f"num_gpu_blocks_override >= {cdiv(model_config.max_model_len, cache_config.block_size)}) or lower "
                "max_model_len."
            )
        self.runner.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(
            vllm_config.scheduler_config, cache_config, vllm_config.lora_config, num_blocks, structured_output_manager
        )
        self.profiler = StepProfiler(vllm_config.device_config.device)
        logger.info(
            "Engine ready in %.1fs: %s on %s (%s), KV cache %d blocks x %d tokens (%.2f GiB, %s)",
            time.time() - started, model_config.architecture, vllm_config.device_config.device,
            str(model_config.dtype).removeprefix("torch."), num_blocks, cache_config.block_size,
            num_blocks * bytes_per_block(model_config, cache_config) / 2**30,
            str(cache_config.kv_dtype(model_config.dtype)).removeprefix("torch."),
        )

    @property
    def lora_adapters(self):
        """The host-side adapter cache (None without LoRA)."""
        manager = self.runner.lora_manager
        return manager.adapters if manager is not None else None

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        with self.profiler.step():
            sched = self.scheduler.schedule()
            try:
                result = self.runner.execute_model(sched)
            except BaseException:
                self.scheduler.discard_step(sched)
                raise
            if sched.is_empty:
                return []
            return self.scheduler.update_from_output(sched, result)

    def add_failure_callback(self, callback) -> None:
        """`callback(reason)` runs when a tensor-parallel rank dies outside a step (no-op otherwise)."""
        if hasattr(self.runner, "add_failure_callback"):
            self.runner.add_failure_callback(callback)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent)."""
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()

    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self) -> str:
        return self.profiler.stop()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(),
            num_blocks=kv.num_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            alora_reused_tokens=kv.stats.alora_reused,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.scheduler.num_prompt_tokens,
            generation_tokens=self.scheduler.num_generation_tokens,
            running_lora_adapters=_adapter_names(self.scheduler.running),
            waiting_lora_adapters=_adapter_names(self.scheduler.waiting),
            max_lora=self.config.lora_config.max_loras if self.config.lora_config else 0,
            num_free_blocks=kv.pool.get_num_free_blocks(),
        )


def _adapter_names(requests) -> tuple[str, ...]:
    """Sorted adapter names of `requests` (a snapshot: the server's scrape runs on another thread)."""
    return tuple(sorted({r.lora_request.lora_name for r in tuple(requests) if r.lora_request is not None}))
