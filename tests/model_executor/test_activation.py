"""The native CPU SiLU-and-mul kernel of vllm/csrc/cpu/activation.cpp (through
layers/activation.py's SiluAndMul) against its torch path (`forward_native`: F.silu, then the
product, HF's numerics): fp32 to a few ulp (its exp is native_vec.h's exp_fast, torch's is Sleef's),
bf16 the same value unless the fp32 result sits on a rounding boundary; over- and underflow, inf
and NaN as torch has them; and the cases that keep the torch path."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.activation import SiluAndMul, native_unavailable_reason

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    reason = native_unavailable_reason()
    assert reason is None, f"the SiLU-and-mul kernel must build on this machine: {reason}"


def assert_close_to_rounding(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ours.dtype == torch.float32:
        # exp within 2 ulp, then a division and a product: a few fp32 ulp of the result.
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-30, equal_nan=True)
        return
    finite, inf = ref.isfinite(), ref.isinf()
    assert torch.equal(ours.isnan(), ref.isnan()) and torch.equal(ours[inf], ref[inf])
    step = ref[finite].float().abs().clamp(min=1e-30) * 2.0**-7  # one bf16 step
    assert ((ours[finite].float() - ref[finite].float()).abs() <= step).all()
    assert (ours[finite] != ref[finite]).float().mean() < 0.02, "only values on a rounding boundary may differ"


# (rows, d): a decode's row, a prefill's rows, a width with a partial last vector (d % 16 != 0).
SHAPES = [((1,), 1536), ((37,), 576), ((5,), 21), ((2, 9), 64), ((300,), 1536)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", SHAPES)
def test_matches_the_torch_path(rows, d, dtype):
    gen = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(*rows, 2 * d, generator=gen)).to(dtype)
    act = SiluAndMul(dtype, CPU)
    assert act.native
    out = act(x)
    assert out.shape == (*rows, d) and out.is_contiguous()
    assert_close_to_rounding(out, SiluAndMul.forward_native(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extremes_as_torch(dtype):
    """exp(-gate) over- and underflows, infinities and NaN give what torch's two ops give."""
    gate = torch.tensor([-200.0, -104.0, -95.0, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 89.0, 200.0,
                         float("inf"), float("-inf"), float("nan"), 3.0, -3.0])
    up = torch.tensor([1.5, -2.0, 3.0, 1.0, 1.0, -1.0, 2.0, 5.0, 2.0, 0.5, 1.0, -1.0, 2.0, 1.0, 1.0, 1.0,
                       float("inf"), float("nan")])
    x = torch.cat([gate, up]).to(dtype).unsqueeze(0)
    ours, ref = SiluAndMul(dtype, CPU)(x), SiluAndMul.forward_native(x)
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(ours.isinf(), ref.isinf()) and torch.equal(ours[ours.isinf()], ref[ref.isinf()])
    finite = ref.isfinite()
    torch.testing.assert_close(ours[finite].float(), ref[finite].float(), rtol=2.0**-7 if dtype == torch.bfloat16
                               else 1e-6, atol=1e-37)


def test_non_contiguous_input_takes_the_torch_path():
    x = torch.randn(6, 2 * 64)[::2]  # every other row: not contiguous
    assert not x.is_contiguous()
    assert torch.equal(SiluAndMul(torch.float32, CPU)(x), SiluAndMul.forward_native(x))


def test_reference_ops_switch_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    act = SiluAndMul(torch.float32, CPU)
    assert not act.native
    x = torch.randn(3, 2 * 40)
    assert torch.equal(act(x), SiluAndMul.forward_native(x))


def test_other_dtypes_keep_the_torch_path():
    assert not SiluAndMul(torch.float16, CPU).native


def test_the_op_refuses_bad_shapes():
    op = torch.ops.vllm_act.silu_and_mul
    x = torch.randn(2, 2 * 8)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        op(torch.empty(2, 4), torch.randn(2, 9))  # odd width
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        op(torch.empty(2, 16), x)  # out not half x's width
    with pytest.raises(RuntimeError, match="of x's dtype"):
        op(torch.empty(2, 8, dtype=torch.bfloat16), x)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.empty(2, 8, dtype=torch.float16), x.half())


def test_llama_mlp_uses_it_for_silu_only():
    from vllm.model_executor.models.llama import DecoderOptions, LlamaMLP

    class Config:
        hidden_size, intermediate_size, hidden_act = 32, 48, "silu"

    mlp = LlamaMLP(Config, DecoderOptions(), torch.float32, CPU)
    assert isinstance(mlp.act_and_mul, SiluAndMul) and mlp.act_and_mul.native
    Config.hidden_act = "gelu"
    assert LlamaMLP(Config, DecoderOptions(), torch.float32, CPU).act_and_mul is None


def test_fp32_within_a_few_ulp_of_the_exact_value():
    """Against float64 over SiLU's whole normal range: exp_fast (on AVX-512: 2 ulp, a two-part
    ln 2 keeping exp(+-85) as accurate as exp(1)), then the sum and the division. Elsewhere
    exp_fast is at::vec's exp_u20, 20 ulp."""
    from vllm.platforms import cpu_has_avx512

    gate = torch.linspace(-87, 87, 400_001)
    x = torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0)
    ours = SiluAndMul(torch.float32, CPU)(x)[0].double()
    exact = gate.double() / (1 + torch.exp(-gate.double()))
    relative = ((ours - exact).abs() / exact.abs()).max().item()
    assert relative <= (3 if cpu_has_avx512() else 24) * 2.0**-23
