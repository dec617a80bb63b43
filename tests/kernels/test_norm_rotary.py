"""Triton RMSNorm (+ residual) and rotary embedding vs the model layers' torch code
(run by the Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from vllm.attention.ops.rms_norm import rms_norm
from vllm.attention.ops.rotary import rotary_embedding
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary import RotaryEmbedding

CPU = torch.device("cpu")


def make_norm(hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5, dtype, CPU)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    x = (3 * torch.randn(5, hidden, generator=gen)).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    return norm, x, residual


@pytest.mark.parametrize("hidden,dtype,tol", [(48, torch.float32, 1e-6), (256, torch.float16, 1e-3)])
def test_rms_norm(hidden, dtype, tol):
    norm, x, _ = make_norm(hidden, dtype)
    expected = norm(x.clone())
    out = rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_residual(dtype):
    norm, x, residual = make_norm(40, dtype, seed=1)
    expected_out, expected_sum = norm(x.clone(), residual.clone())
    x_in = x.clone()
    out, summed = rms_norm(x_in, norm.weight, norm.eps, residual)
    assert torch.equal(summed, expected_sum)  # the add rounds exactly like torch's
    assert summed.data_ptr() == x_in.data_ptr()  # x is overwritten with the sum, as the layer does
    torch.testing.assert_close(out, expected_out, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "head_size,dtype,tol", [(16, torch.float32, 1e-6), (64, torch.float16, 2e-3), (20, torch.float32, 1e-6)]
)
def test_rotary(head_size, dtype, tol):
    rope = RotaryEmbedding(head_size, 64, {"rope_type": "default", "rope_theta": 10000.0}, dtype, CPU)
    gen = torch.Generator().manual_seed(2)
    n, heads, kv_heads = 6, 4, 2
    positions = torch.tensor([0, 5, 63, 17, 17, 2])
    # A fused qkv output: query and key are strided views.
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    query = qkv[:, : heads * head_size].view(n, heads, head_size)
    key = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(n, kv_heads, head_size)
    expected_q, expected_k = rope(positions, query, key)
    q_out, k_out = rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(q_out, expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k_out, expected_k, atol=tol, rtol=tol)
    assert not torch.equal(q_out, query)  # positions > 0 really rotate
