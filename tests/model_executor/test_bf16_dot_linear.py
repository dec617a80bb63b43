"""The vdpbf16ps linear kernel (vllm/csrc/cpu/bf16_dot_linear.cpp) for a few dozen bf16 rows on
CPUs with AVX512-BF16: the float64 product rounded once to bf16 (up to fp32 summation), features
not a multiple of 32 (masked last step), rows and weight rows not multiples of the 4 x 4 tile,
bias; a row's output bitwise the same alone, in a batch and on any thread count; bad inputs
refused; and `dense_linear`'s dispatch: this kernel for every bf16 row up to BF16_DOT_MAX_ROWS
(native_max_rows leaves the GEMV none), F.linear (oneDNN) beyond. Skipped where the CPU lacks AVX512-BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.utils.threads import on_thread_counts
from vllm.model_executor.layers import dense_gemv as d
from vllm.platforms import cpu_has_avx512_bf16


@pytest.fixture(scope="module", autouse=True)
def bf16_dot_kernel():
    if not cpu_has_avx512_bf16():
        pytest.skip("the CPU lacks AVX512-BF16: the kernel is not built here")
    # A compiler that cannot build it where the CPU has it would silently cost the speed: fail.
    assert d.bf16_dot_available(), d.native_build.unavailable_reason(d._BF16_DOT_SOURCE, d._BF16_DOT_WHAT)
    assert d.native_available()


def _inputs(rows: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = torch.randn(n, k, generator=gen).bfloat16()
    return x, weight, torch.randn(n, generator=gen).bfloat16()


# (N, K): K under one step (5), not a multiple of 32 (77), whole steps (64), many steps and a tail
# (1030); N past whole 4-row weight tiles and under one.
SHAPES = [(37, 5), (13, 77), (4, 64), (3, 1030), (41, 576)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, d.BF16_DOT_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_float64_product_rounded_once(n, k, rows, bias):
    x, weight, b = _inputs(rows, n, k, seed=rows * k + n)
    b = b if bias else None
    out = d.bf16_dot_linear(x, weight, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    expected = d.reference_linear(x, weight, b)  # the float64 product, as fp32
    scale = max(1.0, expected.abs().max().item())
    # fp32 summation of k terms, then one bf16 rounding (half a bf16 ulp: 2^-9 relative).
    torch.testing.assert_close(out.float(), expected, atol=4e-7 * k ** 0.5 * scale, rtol=2 ** -8)


def test_leading_dims_and_bias_dtype():
    x, weight, b = _inputs(6, 29, 70, seed=3)
    out = d.bf16_dot_linear(x.view(2, 3, 70), weight, b.float())
    assert out.shape == (2, 3, 29)
    assert torch.equal(out.view(6, 29), d.bf16_dot_linear(x, weight, b))


def test_result_does_not_depend_on_threads_or_batching():
    """A row's output is bitwise the same on 1 or 2 threads and alone or among 32 rows, wherever it
    falls in a tile."""
    x, weight, b = _inputs(d.BF16_DOT_MAX_ROWS, 1001, 1030, seed=2)
    one, two = on_thread_counts(lambda: d.bf16_dot_linear(x, weight, b))
    assert torch.equal(two, one)
    for row in (0, 5, 7, d.BF16_DOT_MAX_ROWS - 1):
        assert torch.equal(d.bf16_dot_linear(x[row:row + 1], weight, b), one[row:row + 1])
    assert torch.equal(d.bf16_dot_linear(x[3:9], weight, b), one[3:9])


def test_bad_inputs_are_refused():
    x, weight, b = _inputs(4, 8, 64, seed=4)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    op = torch.ops.vllm_bf16_dot.bf16_dot_linear
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        op(out, x.float(), weight, None)
    with pytest.raises(RuntimeError, match="weight must be contiguous bf16"):
        op(out, x, weight.t().contiguous().t(), None)
    with pytest.raises(RuntimeError, match="input features"):
        op(out, x, weight[:, :32].contiguous(), None)
    with pytest.raises(RuntimeError, match="out must be contiguous bf16"):
        op(torch.empty(4, 9, dtype=torch.bfloat16), x, weight, None)
    with pytest.raises(RuntimeError, match="bias must be contiguous bf16"):
        op(out, x, weight, b[:3].contiguous())


def test_dense_linear_dispatch_on_rows(monkeypatch):
    """Up to native_max_rows (none here: 0) the GEMV; then this kernel through BF16_DOT_MAX_ROWS, a
    lone decode row included; then F.linear."""
    calls = []
    kernel = d.bf16_dot_linear
    monkeypatch.setattr(d, "bf16_dot_linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    _, weight, b = _inputs(1, 24, 96, seed=5)
    gemv_rows = d.native_max_rows(torch.bfloat16)
    assert gemv_rows == 0
    for rows in (gemv_rows, gemv_rows + 1, d.BF16_DOT_MAX_ROWS, d.BF16_DOT_MAX_ROWS + 1):
        x = _inputs(rows, 24, 96, seed=rows)[0]
        out = d.dense_linear(x, weight, b)
        if gemv_rows < rows <= d.BF16_DOT_MAX_ROWS:
            assert torch.equal(out, kernel(x, weight, b))
        elif rows > d.BF16_DOT_MAX_ROWS:
            assert torch.equal(out, F.linear(x, weight, b))
    assert calls == [gemv_rows + 1, d.BF16_DOT_MAX_ROWS]
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    x = _inputs(8, 24, 96, seed=8)[0]
    assert torch.equal(d.dense_linear(x, weight, b), F.linear(x, weight, b))
    assert calls == [gemv_rows + 1, d.BF16_DOT_MAX_ROWS]


def test_a_decode_row_gets_the_same_output_alone_or_batched():
    """One kernel for every bf16 decode batch (no GEMV below 3 rows, whose fp32-lane order rounds
    differently): a row's output through dense_linear is bitwise the same alone, in a batch of 2
    or 3, or among 16 (this shape's outputs catch the GEMV's order at 1-2 rows)."""
    x, weight, b = _inputs(16, 1001, 1030, seed=9)
    batched = d.dense_linear(x, weight, b)
    for rows in (slice(0, 1), slice(0, 2), slice(0, 3), slice(5, 6)):
        assert torch.equal(d.dense_linear(x[rows], weight, b), batched[rows])


def test_kernel_is_built_with_a_bf16_model(llama_dir, monkeypatch):
    """The model loader builds (or loads) the kernel for a bf16 model, so no request pays for it."""
    from tests.model_executor.configs import model_config_for
    from vllm.model_executor import model_loader

    calls = []
    monkeypatch.setattr(d, "bf16_dot_available", lambda: calls.append(1) or True)
    model_loader.get_model(model_config_for(llama_dir), torch.device("cpu"))
    assert calls == []  # fp32: not needed
    model_loader.get_model(model_config_for(llama_dir, dtype=torch.bfloat16), torch.device("cpu"))
    assert calls == [1]
