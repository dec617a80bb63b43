"""Shared pieces of the benchmarks: model choice, prompt generation, random PEFT
adapters written directly (no PEFT model needed, so 8B shapes are cheap), the
machine's measured matmul rate, and table printing.

Every benchmark reports ratios measured within one run (against a reference run in
the same process or against the physical floor), never a lone absolute time.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Optional

import torch
from safetensors.torch import save_file

GRANITE_8B_SHAPE = dict(
    architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=4096, intermediate_size=12800,
    num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, vocab_size=49159,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0, tie_word_embeddings=True,
    embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=16.0,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="bfloat16",
)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def granite_8b_dummy_dir(root: str) -> str:
    """A folder with a Granite-3.3-8B-shaped config and the default model's tokenizer
    (token ids are random anyway): for `load_format="dummy"` runs."""
    from vllm.model_executor.default_model import ensure_default_model

    path = os.path.join(root, "granite-3.3-8b-shape")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(GRANITE_8B_SHAPE, f)
    source = ensure_default_model()
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            with open(os.path.join(source, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    return path


def random_prompts(vocab_size: int, n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs with lengths uniform in the ranges."""
    rng = random.Random(seed)
    low = min(100, vocab_size - 1)
    return [
        ([rng.randrange(low, vocab_size) for _ in range(rng.randint(*input_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def write_random_adapter(path: str, hf_config, rank: int, targets: list[str], seed: int,
                         invocation_tokens: Optional[list[int]] = None, dtype=torch.float32) -> str:
    """A PEFT-format LoRA (or aLoRA) adapter with random A and B for `hf_config`."""
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h = hf_config.hidden_size
    head = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head, hf_config.num_key_value_heads * head
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, hf_config.intermediate_size), "up_proj": (h, hf_config.intermediate_size),
              "down_proj": (hf_config.intermediate_size, h)}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name in targets:
            parent = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            n_in, n_out = shapes[name]
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).to(dtype)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
              "task_type": "CAUSAL_LM", "bias": "none", "alora_invocation_tokens": invocation_tokens}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def measured_matmul_flops(shapes: list[tuple[int, int]], num_tokens: int, dtype: torch.dtype, device: str) -> float:
    """FLOP/s of this machine on the model's own linear shapes ([tokens, in] x [in, out])."""
    total_flops, total_time = 0.0, 0.0
    for n_in, n_out in shapes:
        x = torch.randn(num_tokens, n_in, dtype=dtype, device=device)
        w = torch.randn(n_out, n_in, dtype=dtype, device=device)
        torch.nn.functional.linear(x, w)
        sync(device)
        reps = 5
        start = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        sync(device)
        total_time += time.perf_counter() - start
        total_flops += 2.0 * num_tokens * n_in * n_out * reps
    return total_flops / total_time


def linear_shapes(hf_config) -> list[tuple[int, int]]:
    h = hf_config.hidden_size
    head = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head, hf_config.num_key_value_heads * head
    i = hf_config.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def forward_flops(hf_config, num_tokens: int, context: int = 0) -> float:
    """FLOPs of a forward pass over `num_tokens` new tokens after `context` cached ones
    (linear layers plus causal attention; the LM head only for the last token)."""
    linear = sum(a * b for a, b in linear_shapes(hf_config)) * hf_config.num_hidden_layers
    h = hf_config.num_attention_heads * (getattr(hf_config, "head_dim", None) or
                                         hf_config.hidden_size // hf_config.num_attention_heads)
    attention_pairs = num_tokens * context + num_tokens * (num_tokens + 1) / 2
    attention = 4.0 * attention_pairs * h * hf_config.num_hidden_layers
    return 2.0 * linear * num_tokens + attention + 2.0 * hf_config.hidden_size * hf_config.vocab_size


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def print_table(title: str, rows: list[tuple], headers: tuple) -> None:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def save_json(path: Optional[str], payload: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")
