"""Frozen engine configuration.

Each component receives the sub-config it uses. `EngineArgs.create_engine_config`
(vllm/engine/arg_utils.py) is the only place that builds these from user options;
after that they never change. Invariants checked here:

- `max_model_len` never exceeds what the model's positions allow unless the user
  asked for it explicitly.
- the KV-cache size is not part of the config: it is measured at start-up and
  handed to the KV-cache manager as `num_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


def hf_num_kv_heads(hf_config) -> int:
    """KV heads of a Hugging Face config: num_key_value_heads, or one per attention head where it
    is absent (or 0), as transformers reads it."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """What the model is and how its numbers are stored."""

    model: str  # the name the user gave (path or hub id)
    model_dir: str  # a local folder with config.json (resolved)
    tokenizer_dir: str
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | pt | dummy
    served_model_names: tuple[str, ...] = ()  # the first is the name responses report
    chat_template: Optional[str] = None  # Jinja text replacing the tokenizer's (LLM(chat_template=...))
    tokenizer_mode: str = "auto"  # auto: the fast tokenizer; slow: use_fast=False
    trust_remote_code: bool = False
    # SamplingParams field -> default for fields a request leaves unset (vllm/sampling_defaults.py)
    sampling_defaults: dict = field(default_factory=dict)
    max_logprobs: int = 20  # most logprobs / prompt logprobs per token a request may ask for
    enforce_eager: bool = False  # True: never capture CUDA graphs (vllm/worker/cuda_graph.py)
    quantization: Optional[str] = None  # weight-only, at load: "int8" | "int4" (layers/quantization.py)
    # A GGUF checkpoint (model_executor/gguf_loader.py): the file; model_dir is then its folder.
    gguf_path: Optional[str] = None

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else self.model

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return hf_num_kv_heads(self.hf_config)

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.hidden_size // self.num_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block geometry, capacity sources and prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    # Capacity, in order of precedence: explicit block count, explicit bytes,
    # VLLM_CPU_KVCACHE_SPACE (CPU), gpu_memory_utilization (GPU).
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_bytes: Optional[int] = None
    # Storage of the cached keys and values; None: the model's dtype. bfloat16 under a float32
    # model halves the cache and the bytes a decode reads; attention then sees the keys and
    # values as stored (rounded to bf16), whichever path computes it.
    cache_dtype: Optional[torch.dtype] = None

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.cache_dtype or model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget and batch limits of one engine step."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # At most this many tokens of one request per step (0: no cap): a long prompt is then
    # chunked even when the budget would take it whole, leaving room for short requests.
    long_prefill_token_threshold: int = 0
    # fcfs: waiting requests in arrival order, the newest running one is preempted first.
    # priority: both by (priority, arrival time), lower priority values first.
    policy: str = "fcfs"


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits. Present only when LoRA is enabled."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    enable_activated_lora: bool = False
    # Dtype of adapter weights and of the adapter computation; None: the model's dtype.
    lora_dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device
    cpu_threads: Optional[int] = None  # CPU backend: torch's intra-op threads; None on CUDA


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks share one model (tensor parallelism, vllm/executor/multiproc.py)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None  # "mp" (one process per rank) or None: mp when size > 1


@dataclass(frozen=True, eq=False)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    lora_config: Optional[LoRAConfig] = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
