"""The native CPU rotary and KV-store ops of vllm/csrc/cpu/rotary_kv.cpp against their torch
paths (RotaryEmbedding._rotate, torch_ref.store_kv): bit for bit in fp32 and bf16, partial
rotary, strided q/k/v views as the models hand them over, padding slots, and the errors for
bad input; and that the layers take the native path on the CPU and the torch one when the
reference ops are forced."""

from __future__ import annotations

import pytest
import torch

from vllm.attention.backends import cpu_native, torch_ref
from vllm.model_executor.layers.rotary import RotaryEmbedding

CPU = torch.device("cpu")
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "max_position_embeddings": 64}


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    reason = cpu_native.rotary_kv_unavailable_reason()
    assert reason is None, f"the rotary/KV-store kernel must build on this machine: {reason}"


def qkv_views(tokens: int, heads: int, kv_heads: int, head_size: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as LlamaAttention makes them: strided views into one fused qkv output."""
    gen = torch.Generator().manual_seed(seed)
    widths = [heads * head_size, kv_heads * head_size, kv_heads * head_size]
    qkv = (2 * torch.randn(tokens, sum(widths), generator=gen)).to(dtype)
    q, k, v = qkv.split(widths, dim=-1)
    return (q.reshape(tokens, heads, head_size), k.reshape(tokens, kv_heads, head_size),
            v.reshape(tokens, kv_heads, head_size))


def torch_rotary(rope: RotaryEmbedding, positions, q, k):
    cos = rope.cos_cache.index_select(0, positions).unsqueeze(1)
    sin = rope.sin_cache.index_select(0, positions).unsqueeze(1)
    return rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_equals_the_torch_path_bitwise(dtype, partial, tokens):
    rope = RotaryEmbedding(32, 64, {**ROPE, "partial_rotary_factor": partial}, dtype, CPU)
    assert rope._native
    q, k, _ = qkv_views(tokens, 6, 2, 32, dtype)
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(1))
    positions[0] = 63
    ours_q, ours_k = rope(positions, q, k)
    ref_q, ref_k = torch_rotary(rope, positions, q, k)
    assert ours_q.is_contiguous() and ours_k.is_contiguous()
    assert torch.equal(ours_q, ref_q) and torch.equal(ours_k, ref_k)


def test_rotary_of_a_real_rope_type_and_int32_positions():
    params = {**ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    rope = RotaryEmbedding(16, 64, params, torch.float32, CPU)
    q, k, _ = qkv_views(5, 4, 4, 16, torch.float32)
    positions = torch.tensor([0, 3, 17, 40, 63], dtype=torch.int32)
    ours = rope(positions, q, k)
    ref = torch_rotary(rope, positions.long(), q, k)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_reference_ops_keep_the_torch_rotary(monkeypatch):
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")  # vllm.envs reads the environment on each access
    assert not RotaryEmbedding(16, 64, ROPE, torch.float32, CPU)._native


def test_rotary_rejects_bad_input_with_a_message():
    rope = RotaryEmbedding(16, 8, ROPE, torch.float32, CPU)
    q, k, _ = qkv_views(2, 4, 2, 16, torch.float32)
    out_q, out_k = torch.empty(q.shape), torch.empty(k.shape)
    op = torch.ops.vllm_rotary_kv.rotary
    with pytest.raises(RuntimeError, match="position 8 outside the rotary cache's \\[0, 8\\)"):
        op(out_q, out_k, q, k, torch.tensor([0, 8]), rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="must have the cos/sin cache's dtype"):
        op(out_q.double(), out_k, q.double(), k, torch.tensor([0, 1]), rope.cos_cache, rope.sin_cache)
    with pytest.raises(RuntimeError, match="positions must be contiguous int64"):
        op(out_q, out_k, q, k, torch.tensor([0]), rope.cos_cache, rope.sin_cache)


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_size: int, dtype: torch.dtype):
    return torch.randn(2, num_blocks, block_size, kv_heads, head_size).to(dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)], ids=["fp32", "bf16", "fp32-to-bf16"])
@pytest.mark.parametrize("tokens", [1, 100])
def test_store_kv_equals_torch_ref_and_skips_padding(dtype, cache_dtype, tokens):
    """fp32 keys into a bf16 cache (--kv-cache-dtype bfloat16) round to nearest even, as torch's cast."""
    _, k, v = qkv_views(tokens, 6, 2, 32, dtype, seed=2)
    cache = make_cache(16, 8, 2, 32, cache_dtype)
    slots = torch.randperm(16 * 8, generator=torch.Generator().manual_seed(3))[:tokens]
    slots[-1] = -1  # a padding token (CUDA-graph padding, a failed step's unwritten slot)
    ours, ref = cache.clone(), cache.clone()
    cpu_native.store_kv(k, v, ours, slots)
    torch_ref.store_kv(k, v, ref, slots)
    assert torch.equal(ours, ref)


def test_store_kv_rounds_every_kind_of_fp32_to_bf16_as_torch():
    """fp32 into a bf16 cache 16 (or 8) values at a time and the rest one by one: ties to even
    both ways, NaNs with payloads and signs, infinities, overflow to infinity, denormals, -0; the
    bits of torch's cast, and a NaN for each NaN (torch's own NaN bits differ between its scalar
    and vector casts: 0x7FC0 or 0xFFFF); 20 values a slot, a vector and a tail."""
    specials = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7FC00001, 0xFFA00000, 0x7F800001, 0x7F800000,
                             0xFF800000, 0x7F7FFFFF, 0x00000001, 0x80008000, 0x80000000, 0x3F80C000, 0x00018000],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(2, 7, 1, 20, generator=gen)
    values.view(-1)[torch.randperm(values.numel(), generator=gen)[:4 * len(specials)]] = specials.repeat(4)
    k, v = values[0], values[1]
    cache = make_cache(2, 4, 1, 20, torch.bfloat16)
    slots = torch.arange(7)
    ours, ref = cache.clone(), cache.clone()
    cpu_native.store_kv(k, v, ours, slots)
    torch_ref.store_kv(k, v, ref, slots)
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan) and nan.sum() == values.isnan().sum() > 0
    assert torch.equal(ours.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def test_store_kv_rejects_bad_input_with_a_message():
    _, k, v = qkv_views(3, 4, 2, 16, torch.float32)
    cache = make_cache(2, 4, 2, 16, torch.float32)
    op = torch.ops.vllm_rotary_kv.store_kv
    with pytest.raises(RuntimeError, match="slot 8 beyond the KV cache's 8 slots"):
        op(cache, k, v, torch.tensor([0, 1, 8]))
    with pytest.raises(RuntimeError, match="key must have the KV cache's dtype"):
        op(cache, k.double(), v, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match=r"key must have the KV cache's dtype Float \(or float32 into a bfloat16"):
        op(cache, k.bfloat16(), v, torch.tensor([0, 1, 2]))  # nothing narrows into a wider cache
    with pytest.raises(RuntimeError, match=r"key must be \[tokens, 2, 16\]"):
        op(cache, k[:, :1], v, torch.tensor([0, 1, 2]))


def test_cpu_attention_layer_stores_through_the_native_op():
    from vllm.attention.layer import Attention

    assert Attention(4, 16, 0.25, 2, CPU)._store_kv is cpu_native.store_kv


def test_rotary_asks_for_the_kernel_when_built_and_falls_back_without_it(monkeypatch):
    """The build is triggered while the model is built (not by the first request); a machine
    where it fails runs the torch path."""
    asked = []
    monkeypatch.setattr(cpu_native, "rotary_kv_unavailable_reason", lambda: asked.append(1) or "no compiler")
    rope = RotaryEmbedding(16, 64, ROPE, torch.float32, CPU)
    assert asked and not rope._native
    q, k, _ = qkv_views(3, 4, 2, 16, torch.float32)
    positions = torch.tensor([1, 2, 3])
    assert all(torch.equal(a, b) for a, b in zip(rope(positions, q, k), torch_rotary(rope, positions, q, k)))
