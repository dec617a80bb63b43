"""The native dense GEMV for few rows on the CPU (vllm/csrc/cpu/dense_gemv.cpp, wrapped by
vllm/model_executor/layers/dense_gemv.py): fp32 and bf16 weights against the float64 reference
on awkward shapes, results independent of the thread count and of how rows are batched, the
portable build without AVX2, bad inputs refused before any work, the layers' dispatch (few rows
native, many rows F.linear, the reference env F.linear throughout, LoRA and tensor-parallel shards
on top), and the engine's greedy tokens and logprobs unchanged against the reference path."""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F

from tests.lora.conftest import generate_one
from tests.utils.threads import on_thread_counts
from vllm import LLM, SamplingParams
from vllm.model_executor.layers import dense_gemv as d
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.tensor_parallel import Shard
from vllm.model_executor.layers.vocab_embedding import LMHead
from vllm.platforms import onednn_packs, use_onednn_linear

CPU = torch.device("cpu")
# K: under one vector (5), not a multiple of 8 (77), over one chunk of 1024 with a tail (1030).
SHAPES = [(37, 5), (37, 77), (13, 1030), (13, 2050)]  # 2050: bf16 rows long enough to be asked ahead


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    return x, weight, torch.randn(n, generator=gen)


def _check(out: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    """Equal to the float64 reference up to fp32 rounding of a k-term sum."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(out, expected, atol=4e-7 * k ** 0.5 * scale, rtol=0)


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    """CI machines have a compiler: a silent fallback to F.linear would hide a build break.
    Every test here may call the op directly, so it is loaded before any of them runs."""
    assert d.native_available(), d.native_build.unavailable_reason(d._SOURCE, d._WHAT)


@pytest.mark.parametrize("dtype", d.WEIGHT_DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, d.NATIVE_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_float64_reference(dtype, n, k, rows, bias):
    x, weight, b = _inputs(rows, n, k, dtype, seed=rows * k + n)
    b = b if bias else None
    out = d.native_linear(x, weight, b)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    _check(out, d.reference_linear(x, weight, b), k)


def test_bf16_activations_come_back_in_bf16():
    x, weight, b = _inputs(3, 37, 77, torch.bfloat16, seed=1)
    out = d.native_linear(x.bfloat16(), weight, b.bfloat16())
    assert out.dtype == torch.bfloat16
    expected = d.reference_linear(x.bfloat16(), weight, b.bfloat16()).bfloat16()
    torch.testing.assert_close(out, expected, atol=0, rtol=2 ** -7)  # at most one bf16 rounding apart


@pytest.mark.parametrize("dtype", d.WEIGHT_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, d.NATIVE_MAX_ROWS])
def test_bf16_x_and_out_are_the_fp32_call_widened_and_rounded_once(dtype, rows):
    """bf16 in, bf16 out: bit for bit the fp32 call on x widened, its out rounded by torch
    (infinities included, NaN where it has NaN), without the conversions' passes around the kernel."""
    op = torch.ops.vllm_dense.dense_gemv
    for n, k in [*SHAPES, (19, 576)]:
        x, weight, b = _inputs(rows, n, k, dtype, seed=rows + n + k)
        x[0, 0], weight[1, 0] = float("inf"), 0.0  # row 0: inf * 0 = NaN in column 1, +-inf elsewhere
        xb = x.bfloat16()
        for bias in (None, b):
            out = torch.empty(rows, n, dtype=torch.bfloat16)
            op(out, xb, weight, bias)
            fp32 = torch.empty(rows, n)
            op(fp32, xb.float(), weight, bias)
            expected = fp32.bfloat16()
            # NaN's payload is not compared: torch's own vector and scalar casts give different ones.
            assert torch.equal(out.isnan(), expected.isnan()) and out[0, 1].isnan()
            assert torch.equal(out.nan_to_num(0).view(torch.int16), expected.nan_to_num(0).view(torch.int16))
    x, weight, b = _inputs(2, 37, 77, dtype, seed=5)
    assert torch.equal(d.native_linear(x.bfloat16(), weight, b), d.native_linear(x.bfloat16().float(), weight, b).bfloat16())


def test_result_does_not_depend_on_threads_or_batching():
    """A row's output is bitwise the same on 1 or 2 threads, alone or among 16 rows of x, and
    whichever weight rows share its tile (tiles take rows spread over the range: a weight with
    rows cut off regroups them all)."""
    x, weight, b = _inputs(d.NATIVE_MAX_ROWS, 1001, 1030, torch.float32, seed=2)
    one, two = on_thread_counts(lambda: d.native_linear(x, weight, b))
    assert torch.equal(two, one)
    for row in (0, 7, d.NATIVE_MAX_ROWS - 1):
        assert torch.equal(d.native_linear(x[row:row + 1], weight, b), one[row:row + 1])
    for start, stop in ((3, 1001), (0, 998), (250, 263)):
        assert torch.equal(d.native_linear(x, weight[start:stop], b[start:stop]), one[:, start:stop])


def test_portable_build_without_avx2_computes_the_same(tmp_path):
    """The plain C++ path, the whole kernel where the compiler does not target AVX2, built here
    without it under its own op namespace."""
    from torch.utils import cpp_extension

    no_avx2 = ["-mno-avx2"] if platform.machine() in ("x86_64", "AMD64") else []  # whatever the default -march
    cpp_extension.load(name="vllm_dense_gemv_portable", sources=[os.path.join(d.native_build.CSRC_CPU, d._SOURCE)],
                       extra_cflags=["-O3", "-fopenmp", "-DVLLM_DENSE_OPS=vllm_dense_portable", *no_avx2],
                       extra_ldflags=["-fopenmp"], build_directory=str(tmp_path), is_python_module=False)
    for dtype in d.WEIGHT_DTYPES:
        for n, k in SHAPES:
            x, weight, b = _inputs(5, n, k, dtype, seed=k)
            out = torch.empty(5, n)
            torch.ops.vllm_dense_portable.dense_gemv(out, x, weight, b)
            _check(out, d.reference_linear(x, weight, b), k)
            _check(out, d.native_linear(x, weight, b), k)
            out_bf16 = torch.empty(5, n, dtype=torch.bfloat16)  # bf16 x widened, out rounded as torch rounds
            torch.ops.vllm_dense_portable.dense_gemv(out_bf16, x.bfloat16(), weight, b)
            widened = torch.empty(5, n)
            torch.ops.vllm_dense_portable.dense_gemv(widened, x.bfloat16().float(), weight, b)
            assert torch.equal(out_bf16, widened.bfloat16())


def test_avx2_build_equals_this_build_bitwise(tmp_path):
    """Where the compiler targets AVX-512 (zmm tiles from 8 rows of x) the sums are the ones an
    AVX2 build makes, bit for bit: same lanes, same order. Elsewhere both builds are AVX2 or
    portable and equal trivially; the test still checks the build runs."""
    from torch.utils import cpp_extension

    x86 = platform.machine() in ("x86_64", "AMD64")
    no_avx512 = ["-march=native", "-mno-avx512f"] if x86 else []
    cpp_extension.load(name="vllm_dense_gemv_avx2", sources=[os.path.join(d.native_build.CSRC_CPU, d._SOURCE)],
                       extra_cflags=["-O3", "-fopenmp", "-DVLLM_DENSE_OPS=vllm_dense_avx2", *no_avx512],
                       extra_ldflags=["-fopenmp"], build_directory=str(tmp_path), is_python_module=False)
    for dtype in d.WEIGHT_DTYPES:
        for n, k in [*SHAPES, (19, 576)]:  # 19 rows: tiles of 8, a pair and a single row
            for rows in (1, 7, 8, 11, d.NATIVE_MAX_ROWS):
                x, weight, b = _inputs(rows, n, k, dtype, seed=rows + k)
                out = torch.empty(rows, n)
                torch.ops.vllm_dense_avx2.dense_gemv(out, x, weight, b)
                assert torch.equal(out, d.native_linear(x, weight, b)), (dtype, n, k, rows)


def test_bad_inputs_are_refused():
    x, weight, b = _inputs(2, 6, 8, torch.float32, seed=3)
    op = torch.ops.vllm_dense.dense_gemv
    with pytest.raises(ValueError, match=r"x must end in the weight's 8 input features, got shape \(2, 7\)"):
        d.native_linear(x[:, :7], weight, None)
    with pytest.raises(ValueError, match=r"weight must be a 2-D fp32 or bf16 tensor \[N, K\], got torch.float16"):
        d.native_linear(x, weight.half(), None)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\), got \(5,\)"):
        d.native_linear(x, weight, b[:5])
    with pytest.raises(RuntimeError, match=r"x must be contiguous fp32 or bf16 \[M, K\], got Double"):
        op(torch.empty(2, 6), x.double(), weight, None)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous fp32 or bf16 \[N, K\]"):
        op(torch.empty(2, 6), x, weight.t().contiguous().t(), None)
    with pytest.raises(RuntimeError, match="weight has 7 input features, x has 8"):
        op(torch.empty(2, 6), x, weight[:, :7].contiguous(), None)
    with pytest.raises(RuntimeError, match=r"out must be contiguous \[M, N\] = \[2, 6\] in x's dtype Float"):
        op(torch.empty(2, 5), x, weight, None)
    with pytest.raises(RuntimeError, match=r"out must be contiguous \[M, N\] = \[2, 6\] in x's dtype BFloat16, "
                                           r"got Float"):
        op(torch.empty(2, 6), x.bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous fp32 \[N\] = \[6\]"):
        op(torch.empty(2, 6), x, weight, b.bfloat16())


def _count_native(monkeypatch) -> list[int]:
    """Rows of each call dense_linear makes to a native kernel: the GEMV (once uses_native holds)
    or the vdpbf16ps kernel (once uses_bf16_dot holds)."""
    calls = []
    for name in ("_gemv", "bf16_dot_linear"):
        real = getattr(d, name)

        def counting(x, weight, bias, real=real):
            calls.append(x.shape[0])
            return real(x, weight, bias)

        monkeypatch.setattr(d, name, counting)
    return calls


def _linear(dtype: torch.dtype, shard=None) -> Linear:
    layer = Linear(48, [40, 24], bias=True, dtype=dtype, device=CPU, shard=shard)
    gen = torch.Generator().manual_seed(4)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen))
    layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    return layer


@pytest.mark.parametrize("dtype", d.WEIGHT_DTYPES)
def test_layers_dispatch_on_rows(dtype, monkeypatch):
    calls = _count_native(monkeypatch)
    layer = _linear(dtype)
    head = LMHead(101, 48, dtype, CPU)
    head.weight.data.copy_(torch.randn(101, 48))
    # Where the vdpbf16ps kernel is built it takes every bf16 row up to BF16_DOT_MAX_ROWS
    # (test_bf16_dot_linear.py): one row runs it, "many" starts past those.
    dot = dtype == torch.bfloat16 and d.bf16_dot_available()
    rows = 1 if dot else d.native_max_rows(dtype)
    many_rows = d.BF16_DOT_MAX_ROWS + 1 if dot else rows + 1
    few, many = torch.randn(rows, 48).to(dtype), torch.randn(many_rows, 48).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias), **tol)
    torch.testing.assert_close(head(few), F.linear(few, head.weight), **tol)
    assert calls == [rows] * 2
    # Prefills: fp32 on fp32_linear, bf16 on F.linear or, on a CPU without native bf16, its widened fp32 form.
    many_path = d.fp32_linear if dtype == torch.float32 else F.linear
    if dtype == torch.bfloat16 and d.bf16_matmul_emulated():
        many_path = d.widened_linear
    assert torch.equal(layer(many), many_path(many, layer.weight, layer.bias))
    assert torch.equal(head(many), many_path(many, head.weight, None))
    assert calls == [rows] * 2
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))
    assert torch.equal(head(few), F.linear(few, head.weight))
    assert calls == [rows] * 2


@pytest.mark.parametrize("bias", [False, True])
def test_widened_bf16_linear_is_the_fp32_product_rounded_once(bias, monkeypatch):
    """Many rows of bf16 where the CPU would emulate bf16: fp32 products over tiles of the
    weight (a small tile here, so several tiles and a short last one), rounded to bf16."""
    monkeypatch.setattr(d, "WIDEN_TILE_ROWS", 16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 77, generator=gen).bfloat16()
    w = torch.randn(37, 77, generator=gen).bfloat16()
    b = torch.randn(37, generator=gen).bfloat16() if bias else None
    out = d.widened_linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (40, 37)
    ref = d.reference_linear(x, w, b)  # float64 sums, returned as fp32
    torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=2.0**-8)  # one bf16 rounding
    torch.testing.assert_close(out, F.linear(x, w, b), atol=0.1, rtol=2e-2)  # torch's emulated bf16
    monkeypatch.setattr(d, "bf16_matmul_emulated", lambda: False)  # a CPU with native bf16: F.linear
    assert not d.uses_widened(x, w)


def test_native_rows_per_dtype_follow_the_cpu():
    """16 rows, fewer where oneDNN catches up sooner: fp32 on AVX-512, bf16 where oneDNN has bf16;
    where the vdpbf16ps kernel runs it takes every bf16 row up to 16, in the native decoder layers
    too (layer_rows: dot above 0 rows; -1 where it never runs)."""
    assert d.native_max_rows(torch.float32) == (8 if d.onednn_fp32_preferred() else d.NATIVE_MAX_ROWS)
    bf16_rows = 0 if d.bf16_dot_available() else 2
    assert d.native_max_rows(torch.bfloat16) == (bf16_rows if onednn_packs(torch.bfloat16) else d.NATIVE_MAX_ROWS)
    fp32, bf16 = torch.empty(4, 4), torch.empty(4, 4, dtype=torch.bfloat16)
    assert d.layer_rows(fp32) == (d.native_max_rows(torch.float32), -1)
    if d.bf16_dot_available():
        assert d.layer_rows(bf16) == (d.NATIVE_MAX_ROWS, 0)
        x = torch.randn(1, 4).bfloat16()
        assert not d.uses_native(x, bf16) and d.uses_bf16_dot(x, bf16)  # a lone decode row too
    else:
        assert d.layer_rows(bf16) == (d.native_max_rows(torch.bfloat16), -1)


@pytest.mark.parametrize("dtype", d.WEIGHT_DTYPES)
def test_weights_stay_row_major_on_the_cpu(dtype):
    """The kernel reads the plain weight: fp32 and bf16 are not repacked for oneDNN (prefills
    read the plain weight too)."""
    assert not use_onednn_linear(CPU, dtype)


@pytest.mark.parametrize("preferred", [False, True])
def test_fp32_linear_runs_onednn_where_preferred(preferred, monkeypatch):
    """Many-row fp32 matmuls: oneDNN on the plain weight where preferred (AVX-512), else
    F.linear; the reference path always F.linear. Both equal the float64 product."""
    if preferred and not onednn_packs(torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    monkeypatch.setattr(d, "onednn_fp32_preferred", lambda: preferred)
    calls = []
    real = d.onednn_linear
    monkeypatch.setattr(d, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(40, 77, generator=gen), torch.randn(37, 77, generator=gen), torch.randn(37, generator=gen)
    torch.testing.assert_close(d.fp32_linear(x, w, b), d.reference_linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(d.fp32_linear(x[::2], w, None), d.reference_linear(x[::2], w), atol=1e-4, rtol=1e-5)
    assert len(calls) == (2 if preferred else 0)
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    assert torch.equal(d.fp32_linear(x, w, b), F.linear(x, w, b))
    assert len(calls) == (2 if preferred else 0)


def test_quantized_prefill_tiles_use_fp32_linear(monkeypatch):
    """The quantized layers' many-row path multiplies its dequantized tiles on fp32_linear."""
    from vllm.model_executor.layers import quantization as q

    calls = []
    monkeypatch.setattr(q, "fp32_linear", lambda x, w, b: calls.append(w.shape) or F.linear(x, w, b))
    weight = q.quantize(torch.randn(37, 64), "int8")
    x = torch.randn(q.native_max_rows(weight) + 1, 64)
    torch.testing.assert_close(q.quantized_linear(x, weight, None), q.reference_linear(x, weight), atol=1e-4, rtol=1e-5)
    assert calls == [(37, 64)]


def test_row_parallel_shard_computes_its_partial_sum(monkeypatch):
    """A row-parallel rank's forward_local is x's columns against its weight columns, no bias."""
    calls = _count_native(monkeypatch)
    full = _linear(torch.float32)
    shard = Shard(in_range=(24, 24))  # rank 1 of 2: the second half of the input features
    layer = _linear(torch.float32, shard=shard)
    layer.weight_loader(layer.weight, full.weight.data, None)
    x = torch.randn(3, 24)
    _check(layer.forward_local(x), d.reference_linear(x, full.weight[:, 24:]), 24)
    assert calls == [3]


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = [generate_one(llm, p, params=params).outputs[0] for p in prompts]
    return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outputs]


def test_engine_greedy_matches_reference_ops(llama_dir, tokenizer, monkeypatch):
    """Decodes on the native kernel, prefills on F.linear: the same tokens as the reference path,
    logprobs within 1e-4."""
    calls = _count_native(monkeypatch)
    prompts = [tokenizer.encode("What is the capital of France?"), tokenizer.encode("one two three " * 8)]
    got = _greedy(LLM(llama_dir, max_model_len=128, dtype="float32"), prompts)
    assert calls and max(calls) <= d.NATIVE_MAX_ROWS
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    calls.clear()
    expected = _greedy(LLM(llama_dir, max_model_len=128, dtype="float32"), prompts)
    assert not calls
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
