"""KV-cache capacity sources, in order of precedence, without a model."""

import torch

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig
from vllm.worker.kv_cache import bytes_per_block, determine_num_blocks


class _HF:
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size, vocab_size = 2, 4, 2, 64, 100


def _model_config():
    return ModelConfig(model="m", model_dir="/m", tokenizer_dir="/m", hf_config=_HF(), architecture="LlamaForCausalLM",
                       dtype=torch.float32, max_model_len=128)


def _blocks(**cache):
    def no_profile():
        raise AssertionError("profiling only happens on CUDA without an explicit size")

    return determine_num_blocks(CacheConfig(block_size=16, **cache), _model_config(), SchedulerConfig(64, 4, 128),
                                torch.device("cpu"), no_profile)


def test_capacity_sources():
    per_block = bytes_per_block(_model_config(), CacheConfig(block_size=16))
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # k+v, layers, tokens, kv heads, head size, fp32
    assert _blocks(num_gpu_blocks_override=7, kv_cache_memory_bytes=per_block * 100) == 7
    assert _blocks(kv_cache_memory_bytes=per_block * 100 + 5) == 100
    assert _blocks(cpu_kvcache_space_bytes=per_block * 30) == 30
    # Default on CPU: what max_num_seqs sequences of max_model_len tokens can use.
    assert _blocks() == 4 * (128 // 16)


def test_vllm_cpu_kvcache_space_env(monkeypatch, llama_dir):
    from vllm import EngineArgs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    config = EngineArgs(model=llama_dir).create_engine_config()
    assert config.cache_config.cpu_kvcache_space_bytes == 1 << 29
