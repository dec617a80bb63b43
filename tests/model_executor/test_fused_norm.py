"""The native CPU RMSNorm (+ residual add) kernel of vllm/csrc/cpu/fused_norm.cpp against the
layer's torch path (`RMSNorm.forward_native`, HF's numerics exactly): the residual sum bit for
bit, the output to fp32 rounding (bf16: at most one bf16 step, where the fp32 value sits on a
rounding boundary), and the cases that keep the torch path."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, native_unavailable_reason

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    reason = native_unavailable_reason()
    assert reason is None, f"the fused norm kernel must build on this machine: {reason}"


def make(hidden: int, rows: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5, dtype, CPU)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    x = (3 * torch.randn(*rows, hidden, generator=gen)).to(dtype)
    residual = torch.randn(*rows, hidden, generator=gen).to(dtype)
    return norm, x, residual


def assert_close_to_rounding(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=2e-6)
        return
    # bf16 keeps 8 significant bits: a different fp32 value may round to the next bf16.
    step = ref.float().abs().clamp(min=1e-30) * 2.0**-7
    assert ((ours.float() - ref.float()).abs() <= step).all()
    assert (ours != ref).float().mean() < 0.02, "only values on a rounding boundary may differ"


CASES = [(576, (1,), torch.float32), (576, (37,), torch.float32), (40, (5,), torch.float32),
         (4096, (3,), torch.float32), (576, (1,), torch.bfloat16), (576, (70,), torch.bfloat16),
         (2048, (2, 9), torch.bfloat16), (64, (3, 4), torch.float32)]


@pytest.mark.parametrize("hidden,rows,dtype", CASES)
def test_fused_add_matches_the_torch_path(hidden, rows, dtype):
    norm, x, residual = make(hidden, rows, dtype)
    assert norm._native
    expected_out, expected_sum = norm.forward_native(x.clone(), residual.clone())
    x_in, residual_in = x.clone(), residual.clone()
    out, summed = norm(x_in, residual_in)
    assert torch.equal(summed, expected_sum), "the residual sum rounds exactly like torch's add"
    assert summed.data_ptr() == x_in.data_ptr(), "x is overwritten with the sum, as on the torch path"
    assert torch.equal(residual_in, residual), "the residual input is only read"
    assert_close_to_rounding(out, expected_out)


@pytest.mark.parametrize("hidden,rows,dtype", CASES)
def test_norm_matches_the_torch_path(hidden, rows, dtype):
    norm, x, _ = make(hidden, rows, dtype, seed=1)
    x_in = x.clone()
    out = norm(x_in)
    assert torch.equal(x_in, x), "the plain norm must not modify its input"
    assert_close_to_rounding(out, norm.forward_native(x.clone()))


def test_fp32_matches_hf_to_rounding():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(576, eps=1e-6)
    torch.nn.init.normal_(hf.weight)
    norm = RMSNorm(576, 1e-6, torch.float32, CPU)
    norm.weight.data.copy_(hf.weight.data)
    x, residual = torch.randn(7, 576), torch.randn(7, 576)
    out, summed = norm(x.clone(), residual)
    assert torch.equal(summed, x + residual)
    assert_close_to_rounding(out, hf(x + residual))


def test_other_cases_keep_the_torch_path(monkeypatch):
    norm, x, residual = make(64, (4,), torch.float32)
    strided = torch.randn(4, 128)[:, :64]  # not contiguous: the torch path, same answer as before
    assert torch.equal(norm(strided), norm.forward_native(strided))
    assert not RMSNorm(64, 1e-5, torch.float16, CPU)._native
    assert not GemmaRMSNorm(64, 1e-5, torch.float32, CPU)._native, "Gemma's numerics differ: its own torch path"
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    reference = RMSNorm(64, 1e-5, torch.float32, CPU)
    assert not reference._native
    reference.weight.data.copy_(norm.weight.data)
    out, _ = reference(x.clone(), residual)
    assert torch.equal(out, norm.forward_native(x.clone(), residual)[0])


def test_kernel_rejects_bad_inputs():
    x, weight = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.vllm_norm.rms_norm(torch.empty(3, 8, dtype=torch.float16), x.half(), weight.half(), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous \[8\]"):
        torch.ops.vllm_norm.rms_norm(torch.empty(3, 8), x, torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="must not alias"):
        torch.ops.vllm_norm.fused_add_rms_norm(x, x, torch.randn(3, 8), weight, 1e-5)
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        torch.ops.vllm_norm.fused_add_rms_norm(torch.empty(3, 8), x, torch.randn(3, 9), weight, 1e-5)
