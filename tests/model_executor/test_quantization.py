"""Weight-only int8 / int4 quantization at load (vllm/model_executor/layers/quantization.py and
vllm/csrc/cpu/quant_linear.cpp): the stated rounding and packing of weights and activations, the
native kernel (AVX2 and its portable build) and the tiled torch path against `reference_linear`,
the LM head's per-channel int8 copy (tied and untied, quantized at load or loaded packed), and the
engine on a checkpoint whose weights are already on the quantization grid (or on GGUF Q4_1's, which
int4 keeps), where quantizing is lossless and the engine must match transformers (and PEFT, with an adapter on top) given the same
activation rounding: the same greedy tokens, logprobs within what one flipped rounding tie moves;
with two tensor-parallel ranks, the same tokens as one."""

from __future__ import annotations

import json
import os
import platform
import shutil
from typing import Optional

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.lora.conftest import generate_one
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.threads import on_thread_counts
from tests.utils.checkpoints import load_hf_model
from tests.utils.reference import hf_greedy
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor import gguf_loader
from vllm.model_executor.layers import quantization as q
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.vocab_embedding import HEAD_METHOD, LMHead, VocabEmbedding

CPU = torch.device("cpu")


def test_int8_rounds_per_channel():
    w = torch.tensor([[0.5, -1.27, 0.0, 1.0], [2.0, 1.0, -0.5, 0.013]])
    qw = q.quantize(w, "int8")
    assert qw.qweight.dtype == torch.int8 and qw.group == 4
    torch.testing.assert_close(qw.scales.view(-1), torch.tensor([1.27 / 127, 2.0 / 127]))
    assert qw.qweight.tolist() == [[50, -127, 0, 100], [127, 64, -32, 1]]  # round half to even: 63.5 -> 64
    assert (qw.dequantize() - w).abs().max() <= qw.scales.max() / 2


def test_int4_packs_two_per_byte_in_gguf_block_order():
    # Off a min-max 16-level grid (-8 .. 6 in steps of 14/15 misses 3), so rounded symmetrically.
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 16], w[0, 5], w[0, 31] = -8.0, 6.0, 3.0, 1.0  # scale -8 / -8 = 1
    w[1, 3], w[1, 9], w[1, 20] = 4.0, -1.0, 0.5  # the largest magnitude positive: scale -0.5, 4 -> -8
    qw = q.quantize(w, "int4")
    assert qw.qweight.shape == (2, 16) and qw.qweight.dtype == torch.uint8 and qw.scales.shape == (2, 1)
    assert qw.scales.dtype == torch.bfloat16 and qw.nbytes == 2 * (16 + 2)  # Q4_0's 4.5 bits a weight
    assert qw.scales.view(-1).tolist() == [1.0, -0.5]
    packed = qw.qweight[0].tolist()
    assert packed[0] == (-8 + 8) | ((6 + 8) << 4)  # element 0 low nibble, element 16 high nibble
    assert packed[5] == (3 + 8) | (8 << 4)
    assert packed[15] == 8 | ((1 + 8) << 4)  # element 15 low, element 31 high
    assert qw.qweight[1, 3].item() & 0x0F == 0 and qw.qweight[1, 9].item() & 0x0F == 2 + 8
    torch.testing.assert_close(qw.dequantize(), w)
    zero = q.quantize(torch.zeros(1, 32), "int4")  # scale 0, every value 0
    assert zero.scales.item() == 0 and torch.equal(zero.dequantize(), torch.zeros(1, 32))
    with pytest.raises(ValueError, match="multiples of 32, got 48"):
        q.quantize(torch.randn(2, 48), "int4")
    with pytest.raises(ValueError, match="Unknown quantization 'int3'; supported: int8, int4"):
        q.quantize(w, "int3")


def test_int4_uses_all_16_levels_as_gguf_q4_0_does():
    """The largest magnitude maps to -8 (GGUF Q4_0's rule): less weight error than max|W| / 7 on 15
    levels, and a weight already on such a grid comes back exactly."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    qw = q.quantize(w, "int4")
    groups = w.view(64, -1, 32)
    fifteen = (groups.abs().amax(dim=2, keepdim=True) / 7).bfloat16().float()
    old = (torch.round(groups / fifteen).clamp(-8, 7) * fifteen).view_as(w)
    assert (qw.dequantize() - w).norm() < 0.9 * (old - w).norm()
    assert torch.equal(q.quantize(qw.dequantize(), "int4").dequantize(), qw.dequantize())


def test_int4_keeps_a_4_bit_grid_the_weight_already_lies_on():
    """A weight dequantized from GGUF Q4_1 (d * q + m per 32, q in 0..15: the packaged default
    model's linears) is kept on its own grid, which the symmetric one cannot hold: in fp32 the
    Q4_1 file's own tensors, in bf16 the same nibbles with its scales and offsets within bf16's
    rounding. One weight a third of a step off that grid (in a row probed first or not), and it
    is rounded symmetrically."""
    w = np.random.RandomState(0).randn(16, 512).astype(np.float32) * 0.2
    raw = gguf.quants.quantize(w, GGMLQuantizationType.Q4_1)
    stored = gguf_loader._q4_1(torch.from_numpy(raw).view(16, -1, 20), 16, 512)
    checkpoint = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_1))
    kept = q.quantize(checkpoint, "int4")
    assert kept.scales.dtype == kept.offsets.dtype == torch.float16 and kept.nbytes == raw.nbytes  # Q4_1's bytes
    assert all(torch.equal(a, b) for a, b in zip(kept.tensors(), stored.tensors()))
    assert kept.scales.stride(0) == 2 * 16 and kept.offsets.data_ptr() == kept.scales.data_ptr() + 16 * 2  # beside
    from_bf16 = q.quantize(checkpoint.bfloat16(), "int4")
    assert from_bf16.offsets is not None and torch.equal(from_bf16.qweight, stored.qweight)
    assert (from_bf16.dequantize() - stored.dequantize()).abs().max() <= 2 ** -8 * checkpoint.abs().max()
    for row in (3, q.GRID_PROBE_ROWS + 4):  # among the rows probed first, and past them
        off = checkpoint.clone()
        off[row, 40] += stored.group_scales()[row, 1] / 3
        rounded = q.quantize(off, "int4")
        assert rounded.offsets is None and rounded.scales.dtype == torch.bfloat16


def test_activations_round_per_block_of_32():
    x = torch.zeros(2, 40)
    x[0, :5] = torch.tensor([127.0, -0.5, 1.5, 2.5, 63.5])  # scale 1: ties round half to even
    x[0, 32:] = torch.arange(8) * -0.5  # the short last block has its own scale, 3.5 / 127
    xq, xs = q.quantize_activations(x)
    assert xq.dtype == torch.int8 and xq.shape == (2, 40) and xs.shape == (2, 2)
    torch.testing.assert_close(xs, torch.tensor([[1.0, 3.5 / 127], [0.0, 0.0]]))  # an all-zero block: scale 0
    assert xq[0, :5].tolist() == [127, 0, 2, 2, 64] and xq[0, 5:32].eq(0).all() and xq[1].eq(0).all()
    assert xq[0, 32:].tolist() == [0, -18, -36, -54, -73, -91, -109, -127]
    torch.testing.assert_close(q.round_activations(x), xq.float() * xs.repeat_interleave(32, dim=1)[:, :40])


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows at different scales, an all-zero block and the rounding ties of the test above."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
    x[0, :32] = 0
    x[-1, :32] = 0
    x[-1, :5] = torch.tensor([127.0, -0.5, 1.5, 2.5, 63.5])
    return x


@pytest.mark.parametrize("k", [576, 40])  # 40: a short last block
def test_native_rounding_equals_torch_bitwise(k):
    """The torch path's dense matmuls take x' from one native pass."""
    assert q.native_available()
    x = _activations(37, k, seed=k)
    out = torch.empty_like(x)
    torch.ops.vllm_quant.round_activations(out, x)
    assert torch.equal(out, q.round_activations(x))


def _weight(method: str, n: int, k: int, group: Optional[int], gen: torch.Generator) -> q.QuantizedWeight:
    """`method`'s weight, regrouped to `group` input features per scale (GGUF's Q8_0 is int8 with
    group 32, Q6_K's sub-blocks group 16) with int8 values over the full range, -128 included."""
    weight = q.quantize(torch.randn(n, k, generator=gen), method)
    if group is None:
        return weight
    qweight = weight.qweight
    if method == "int8":
        qweight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return q.QuantizedWeight(method, qweight, torch.rand(n, k // group, generator=gen) / 100, group, k)


def _check_kernel(out: torch.Tensor, x: torch.Tensor, weight: q.QuantizedWeight) -> None:
    """out equals reference_linear to fp32 rounding, far closer than the unrounded activations' result."""
    expected = q.reference_linear(x, weight)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, atol=1e-6 * scale, rtol=0)
    assert (x.float() @ weight.dequantize().T - expected).abs().max() > 1e-4 * scale  # the rounding is seen


@pytest.mark.parametrize("method", q.METHODS)
@pytest.mark.parametrize("rows", [1, 3, 40, "most", "more"])  # up to native_max_rows: native kernel; beyond: torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_equals_reference(method, rows, dtype, monkeypatch):
    monkeypatch.setattr(q, "TILE_ROWS", 40)  # several tiles over 97 outputs
    gen = torch.Generator().manual_seed(len(str(rows)))
    weight = q.quantize(torch.randn(97, 128, generator=gen), method)  # 97: a tail after the 4-row tiles
    rows = {"most": q.native_max_rows(weight), "more": q.native_max_rows(weight) + 1}.get(rows, rows)
    x = torch.randn(rows, 128, generator=gen).to(dtype)
    bias = torch.randn(97, generator=gen).to(dtype)
    out = q.quantized_linear(x, weight, bias)
    assert out.dtype == dtype
    if dtype == torch.float32:
        _check_kernel(out - bias, x, weight)
    else:
        torch.testing.assert_close(out, (q.reference_linear(x, weight) + bias.float()).to(dtype), atol=2e-2, rtol=1e-2)


def test_native_rows_follow_the_weight_format(monkeypatch):
    """Each format's products run the native kernel up to its own row count (the formats whose
    integer sums need the fewest per-row scalings the furthest), the tiled torch path beyond it
    (a decoder layer of mixed formats: test_gguf.py)."""
    gen = torch.Generator().manual_seed(0)
    formats = {"int4": _weight("int4", 37, 512, None, gen), "int8": _weight("int8", 37, 512, None, gen),
               "Q8_0": _weight("int8", 37, 512, 32, gen), "Q6_K": _q6_k(37, 512, gen), "Q4_K": _kquant(37, 512, gen)}
    limits = {name: q.native_max_rows(weight) for name, weight in formats.items()}
    assert limits == {"int4": q.NATIVE_MAX_ROWS_INT4, "int8": q.NATIVE_MAX_ROWS_INT8,
                      "Q8_0": q.NATIVE_MAX_ROWS_INT8_GROUPED, "Q6_K": q.NATIVE_MAX_ROWS_INT8_GROUPED,
                      "Q4_K": q.NATIVE_MAX_ROWS_INT4}
    assert q.NATIVE_MAX_ROWS_INT4 >= q.NATIVE_MAX_ROWS_INT8 >= q.NATIVE_MAX_ROWS_INT8_GROUPED >= 16
    native = q._native_linear
    calls = []
    monkeypatch.setattr(q, "_native_linear", lambda *a: calls.append(a[1].shape[0]) or native(*a))
    for name, weight in formats.items():
        for rows in (limits[name], limits[name] + 1):
            calls.clear()
            x = torch.randn(rows, 512, generator=gen)
            expected = q.reference_linear(x, weight)
            torch.testing.assert_close(q.quantized_linear(x, weight, None), expected, rtol=0,
                                       atol=1e-5 * expected.abs().max().item())
            assert calls == ([rows] if rows == limits[name] else []), name


# (method, K, group): per channel with a short last activation block, GGUF Q8_0 (32) and Q6_K (16)
# groups, groups the vector path does not take (24, 48: the scalar path), int4 groups of 64, int4
# groups of 32 over an odd number of blocks (the per-block path, bf16 scales read as an fp32
# copy), over SmolLM2's 576 features (18 blocks: the paired path, on bf16 scales as quantized at
# load and on fp32 ones as GGUF's Q4_K gives) and over 6,144 (rows of 3 KB, the paired path on
# long rows; on AVX512-VNNI eight pairs at a time, and over 832 features one eight, one four and
# one more); int8 rows of 4 KB and more (one row of x asks their streams ahead) with a short last
# block.
GROUPED = [("int8", 40, None), ("int8", 4136, None), ("int8", 96, 32), ("int8", 96, 16), ("int8", 72, 24), ("int8", 96, 48),
           ("int4", 192, 64), ("int4", 96, None), ("int4", 576, None), ("int4", 576, 32), ("int4", 6144, None),
           ("int4", 128, 32), ("int4", 448, 32), ("int4", 640, 32),  # paired: 2, 7, 10 pairs (fours and 2-3 more)
           ("int4", 832, 32)]  # 13 pairs


@pytest.mark.parametrize(("method", "k", "group"), GROUPED)
@pytest.mark.parametrize("rows", [1, 5])
def test_native_kernel_on_every_weight_grouping(method, k, group, rows):
    gen = torch.Generator().manual_seed(k + rows)
    weight = _weight(method, 37, k, group, gen)
    x = torch.randn(rows, k, generator=gen)
    x[0, :32] = 0  # an all-zero block (scale 0)
    _check_kernel(q.quantized_linear(x, weight, None), x, weight)


@pytest.mark.parametrize(("k", "group"), [(576, 32), (512, 64), (96, 32), (6144, 32)])  # paired, grouped, per block
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["fp32", "q4_1 mins"])
def test_int4_kernel_adds_gguf_offsets(k, group, rows, dtype, form):
    """Per-group offsets (w = s * q + offset of the group) are added by the kernel itself, on every
    int4 path and with bf16 activations and output: fp32 ones, or GGUF Q4_1's fp16 mins m beside
    fp16 scales (offset m + 8s; the paired path computes s * stored nibble + m); a malformed offsets
    tensor is refused."""
    gen = torch.Generator().manual_seed(k + rows)
    base = _weight("int4", 37, k, group, gen)
    offsets = torch.randn(37, k // base.group, generator=gen) / 50
    weight = q.QuantizedWeight("int4", base.qweight, base.scales, base.group, k, offsets)
    if form == "q4_1 mins":
        base = q.QuantizedWeight("int4", base.qweight, base.scales.half(), base.group, k)
        weight = q.QuantizedWeight("int4", base.qweight, base.scales, base.group, k, offsets.half())
    x = torch.randn(rows, k, generator=gen)
    if dtype == torch.float32:
        out = q.quantized_linear(x, weight, None)
        _check_kernel(out, x, weight)
        assert (out - q.quantized_linear(x, base, None)).abs().max() > 1e-3  # the offsets count
    else:
        out = q.quantized_linear(x.to(dtype), weight, None)
        fp32 = q.quantized_linear(x.to(dtype).float(), weight, None)
        assert out.dtype == dtype and torch.equal(out, fp32.to(dtype))
    with pytest.raises(RuntimeError, match=r"offsets must be \[N, K / group\] with the scales' row pitch"):
        torch.ops.vllm_quant.linear_int4(torch.empty(rows, 37), x, base.qweight, base.scales, base.group,
                                         weight.offsets[:, :-1])
    if form == "q4_1 mins":
        # Kept side by side, as quantization.py keeps them (each row's scales, then its mins), the
        # same sums; fp16 mins need fp16 scales, and the scales' row pitch.
        scales, mins = q.q4_1_scales_and_mins(weight.scales, weight.offsets)
        assert scales.stride(0) == mins.stride(0) == 2 * scales.shape[1]
        side_by_side = q.QuantizedWeight("int4", base.qweight, scales, base.group, k, mins)
        assert torch.equal(q.quantized_linear(x.to(dtype), side_by_side, None), out)
        with pytest.raises(RuntimeError, match=r"fp32 or \(with fp16 scales\) fp16 mins"):
            torch.ops.vllm_quant.linear_int4(torch.empty(rows, 37), x, base.qweight, base.scales.float(),
                                             base.group, weight.offsets)
        with pytest.raises(RuntimeError, match="the scales' row pitch"):
            torch.ops.vllm_quant.linear_int4(torch.empty(rows, 37), x, base.qweight, scales, base.group,
                                             weight.offsets)


def _kquant(n: int, k: int, gen: torch.Generator) -> q.QuantizedWeight:
    """A GGUF Q4_K weight in its two-level form: random nibbles, 6-bit sc / m, fp16-valued d / dmin."""
    qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    sc, m = (torch.randint(0, 64, (n, k // 32), generator=gen, dtype=torch.uint8) for _ in range(2))
    superblocks = (torch.rand(n, k // 256, 2, generator=gen) / 200).half().float()
    return q.QuantizedWeight("int4", qweight, sc, 32, k, m, superblocks)


@pytest.mark.parametrize("k", [512, 2048])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_kernel_reads_k_quants_in_their_two_level_form(k, rows):
    """Q4_K as the file keeps it (d, dmin per 256, 6-bit sc, m per 32: 0.59 bytes a weight) against
    the reference and against its fp32 scales and offsets (which the kernel adds after the sums
    where it adds Q4_K's per superblock: the same to fp32 rounding); bf16 in and out too."""
    gen = torch.Generator().manual_seed(k + rows)
    weight = _kquant(37, k, gen)
    expanded = q.QuantizedWeight("int4", weight.qweight, weight.group_scales(), 32, k, weight.group_offsets())
    assert weight.nbytes < 0.6 * 37 * k and torch.equal(weight.dequantize(), expanded.dequantize())
    x = torch.randn(rows, k, generator=gen)
    out = q.quantized_linear(x, weight, None)
    _check_kernel(out, x, weight)
    _check_kernel(q.quantized_linear(x, expanded, None), x, expanded)
    xb = x.to(torch.bfloat16)
    assert torch.equal(q.quantized_linear(xb, weight, None), q.quantized_linear(xb.float(), weight, None).to(xb.dtype))
    stacked = q.stack_rows([weight, weight.rows(slice(0, 5))])
    assert torch.equal(q.quantized_linear(x, stacked, None), torch.cat([out, out[:, :5]], dim=1))
    with pytest.raises(RuntimeError, match="superblocks must be contiguous fp32"):
        torch.ops.vllm_quant.linear_int4(out, x, weight.qweight, weight.scales, 32, weight.offsets,
                                         weight.superblocks[:, :-1])
    with pytest.raises(RuntimeError, match="offsets must be contiguous uint8"):
        torch.ops.vllm_quant.linear_int4(out, x, weight.qweight, weight.scales, 32, None, weight.superblocks)


def _q6_k(n: int, k: int, gen: torch.Generator) -> q.QuantizedWeight:
    """A GGUF Q6_K weight in its two-level form: values -32..31, int8 sc per 16, fp16-valued d per 256."""
    qweight = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    sc = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 256, 1, generator=gen) / 500).half().float()
    return q.QuantizedWeight("int8", qweight, sc, 16, k, superblocks=d)


@pytest.mark.parametrize("k", [512, 2048])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_kernel_reads_q6_k_in_its_two_level_form(k, rows):
    """Q6_K as the file keeps it (d per 256, int8 sc per 16: 1.08 bytes a weight) gives bit for bit
    what its fp32 scales d * sc give (formed exactly in the loop), and the reference."""
    gen = torch.Generator().manual_seed(k + rows)
    weight = _q6_k(37, k, gen)
    expanded = q.QuantizedWeight("int8", weight.qweight, weight.group_scales(), 16, k)
    assert weight.nbytes < 1.1 * 37 * k and torch.equal(weight.dequantize(), expanded.dequantize())
    x = torch.randn(rows, k, generator=gen)
    out = q.quantized_linear(x, weight, None)
    assert torch.equal(out, q.quantized_linear(x, expanded, None))
    _check_kernel(out, x, weight)
    with pytest.raises(RuntimeError, match="superblocks must be contiguous fp32"):
        torch.ops.vllm_quant.linear_int8(out, x, weight.qweight, weight.scales, 32, weight.superblocks)


# int8 in groups of 32 (GGUF Q8_0's fp16 d) and in groups of 64: dot_blocks reads the scales as
# stored; 8192 features: rows long enough that one row of x asks each row's stream ahead.
@pytest.mark.parametrize(("k", "group"), [(576, 32), (8192, 32), (576, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_kernel_reads_scales_as_stored(dtype, k, group, rows):
    """fp16 / bf16 scales give bit for bit what their fp32 values give, and the reference."""
    gen = torch.Generator().manual_seed(k + rows + group)
    weight = _weight("int8", 37, k, group, gen)
    stored = q.QuantizedWeight("int8", weight.qweight, weight.scales.to(dtype), group, k)
    widened = q.QuantizedWeight("int8", weight.qweight, stored.scales.float(), group, k)
    x = torch.randn(rows, k, generator=gen)
    out = q.quantized_linear(x, stored, None)
    assert torch.equal(out, q.quantized_linear(x, widened, None))
    _check_kernel(out, x, stored)


# The paired path reads them as stored (2048: rows long enough that one row of x asks each row's
# stream ahead); 3 blocks: an fp32 copy.
@pytest.mark.parametrize("k", [576, 2048, 96])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_kernel_reads_scales_as_stored(dtype, k, rows):
    """bf16 scales (int4 quantized at load), fp16 ones (GGUF Q4_0's d) and fp32 ones against the
    reference (the paired path reads each in its own even-then-odd block order)."""
    gen = torch.Generator().manual_seed(k + rows)
    weight = q.quantize(torch.randn(37, k, generator=gen), "int4")
    weight = q.QuantizedWeight("int4", weight.qweight, weight.scales.to(dtype), weight.group, k)
    x = torch.randn(rows, k, generator=gen)
    _check_kernel(q.quantized_linear(x, weight, None), x, weight)


@pytest.mark.parametrize("method", q.METHODS)
@pytest.mark.parametrize(("rows", "k"), [(1, 576), (5, 576), (1, 4128), (3, 96)])  # 96 int4: 3 blocks, per block
def test_kernel_takes_bf16_activations_and_output_as_the_conversions_would(method, rows, k):
    """A bf16 x is widened and a bf16 out rounded inside the kernel: bitwise the fp32 call on
    x.float() rounded to bf16 (what quantized_linear did with conversion ops), which quantized_linear
    now skips where there is no bias; with a bias it still adds it before rounding."""
    assert q.native_available()
    gen = torch.Generator().manual_seed(k + rows)
    weight = q.quantize(torch.randn(37, k, generator=gen), method)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    op = torch.ops.vllm_quant.linear_int8 if method == "int8" else torch.ops.vllm_quant.linear_int4
    fp32 = torch.empty(rows, 37)
    op(fp32, x.float(), weight.qweight, weight.scales, weight.group)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(rows, 37, dtype=out_dtype)
        op(out, x, weight.qweight, weight.scales, weight.group)
        assert torch.equal(out, fp32.to(out_dtype))
    assert torch.equal(q.quantized_linear(x, weight, None), fp32.to(torch.bfloat16))
    bias = torch.randn(37, generator=gen).to(torch.bfloat16)
    assert torch.equal(q.quantized_linear(x, weight, bias), (fp32 + bias.float()).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be contiguous fp32 or bf16"):
        op(out, x.half(), weight.qweight, weight.scales, weight.group)


@pytest.mark.parametrize("method", q.METHODS)
def test_native_kernel_does_not_depend_on_the_thread_count_or_tiles(method):
    """Bitwise the same on 1 or 2 threads, and whichever weight rows share a row's tile (tiles
    take rows spread over the range for one row of x, and int8's for several: a weight with rows
    cut off regroups them all), for one row of x and for three."""
    gen = torch.Generator().manual_seed(0)
    weight, x = q.quantize(torch.randn(1000, 256, generator=gen), method), torch.randn(3, 256, generator=gen)
    for rows in (x[:1], x):
        one, two = on_thread_counts(lambda: q.quantized_linear(rows, weight, None))
        assert torch.equal(two, one)
        for start, stop in ((3, 1000), (0, 997), (250, 263)):
            part = q.QuantizedWeight(method, weight.qweight[start:stop], weight.scales[start:stop], weight.group, 256)
            assert torch.equal(q.quantized_linear(rows, part, None), one[:, start:stop])


@pytest.mark.parametrize("k", [576, 832, 6144])
@pytest.mark.parametrize("method", q.METHODS)
def test_native_kernel_gives_a_row_the_same_result_in_any_batch(method, k):
    """A token decoded alone or among others gets bitwise the same output (x is laid out per row;
    int4's paired path takes tiles of rows spread over the range alone and neighbouring tiles in a
    batch, with the nibbles unpacked once for all rows of x and two rows of x sharing each pass over
    them, an odd last row alone)."""
    gen = torch.Generator().manual_seed(3)
    weight, x = q.quantize(torch.randn(101, k, generator=gen), method), torch.randn(16, k, generator=gen)
    others = {"int8": [_weight(method, 101, k, 64, gen)],  # int8 in groups of 64 too
              "int4": [_kquant(101, k, gen)] if k % 256 == 0 else []}[method]  # and Q4_K's two-level form
    for w in [weight, *others]:
        for rows in (16, 5, 2):  # int8 takes 4+ rows of x (2+ of 2048+ features) two at a time
            batched = q.quantized_linear(x[:rows], w, None)
            for i in sorted({0, min(3, rows - 1), rows - 1}):
                assert torch.equal(q.quantized_linear(x[i:i + 1], w, None), batched[i:i + 1])


def test_native_kernel_reuses_its_workspace_across_shapes_and_threads():
    """x's layout lives in a per-thread workspace kept from call to call: a call after others of
    larger and smaller shapes, batches (one whose buffers outgrow what a thread keeps, freed after
    it), output dtypes, with and without Q4_K's offsets, gives bitwise what the same call
    gives first on a thread of its own; so do calls racing on two threads."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(11)
    int4_576, int4_6144 = (q.quantize(torch.randn(67, k, generator=gen), "int4") for k in (576, 6144))
    int8_576 = q.quantize(torch.randn(45, 576, generator=gen), "int8")
    q4k = _kquant(29, 2048, gen)
    wide = q.quantize(torch.randn(8200, 256, generator=gen), "int4")  # 2048 rows: 67 MB of bf16 out's sums
    calls = [(w, torch.randn(rows, w.in_features, generator=gen).to(dtype))
             for w, rows, dtype in ((int4_6144, 5, torch.float32), (int4_576, 1, torch.bfloat16),
                                    (q4k, 3, torch.float32), (int4_576, 7, torch.float32),
                                    (int8_576, 2, torch.bfloat16), (wide, 2048, torch.bfloat16),
                                    (q4k, 1, torch.bfloat16),
                                    (int4_6144, 1, torch.float32))]
    def run(call):
        return q.quantized_linear(call[1], call[0], None)

    def fresh(call):
        result = []
        thread = threading.Thread(target=lambda: result.append(run(call)))
        thread.start()
        thread.join()
        return result[0]

    first = [fresh(call) for call in calls]
    for order in (range(len(calls)), reversed(range(len(calls)))):
        for i in order:
            assert torch.equal(run(calls[i]), first[i]), i
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            for i, out in zip(range(len(calls)), pool.map(run, calls)):
                assert torch.equal(out, first[i]), i


def test_portable_build_without_avx2_computes_the_same(tmp_path):
    """The scalar path, the whole kernel where the compiler does not target AVX2, built here
    without -march under its own op namespace."""
    from torch.utils import cpp_extension

    no_avx2 = ["-mno-avx2"] if platform.machine() in ("x86_64", "AMD64") else []  # whatever the default -march
    cpp_extension.load(name="vllm_quant_linear_portable", sources=[os.path.join(q.native_build.CSRC_CPU, q._SOURCE)],
                       extra_cflags=["-O3", "-fopenmp", "-DVLLM_QUANT_OPS=vllm_quant_portable", *no_avx2],
                       extra_ldflags=["-fopenmp"], build_directory=str(tmp_path), is_python_module=False)
    ops = torch.ops.vllm_quant_portable
    for method, k, group in GROUPED:
        gen = torch.Generator().manual_seed(k)
        weight, x = _weight(method, 37, k, group, gen), torch.randn(3, k, generator=gen)
        out = torch.empty(3, 37)
        (ops.linear_int8 if method == "int8" else ops.linear_int4)(out, x, weight.qweight, weight.scales, weight.group)
        _check_kernel(out, x, weight)
    gen = torch.Generator().manual_seed(7)
    base = _weight("int4", 37, 576, 32, gen)
    weight = q.QuantizedWeight("int4", base.qweight, base.scales, 32, 576, torch.randn(37, 18, generator=gen) / 50)
    x = torch.randn(3, 576, generator=gen)
    ops.linear_int4(out, x, weight.qweight, weight.scales, 32, weight.offsets)
    _check_kernel(out, x, weight)
    scales, mins = q.q4_1_scales_and_mins(base.scales.half(), weight.offsets.half())  # fp16 mins, side by side
    q4_1 = q.QuantizedWeight("int4", base.qweight, scales, 32, 576, mins)
    ops.linear_int4(out, x, q4_1.qweight, q4_1.scales, 32, q4_1.offsets)
    _check_kernel(out, x, q4_1)
    kquant = _kquant(37, 512, gen)
    x = torch.randn(3, 512, generator=gen)
    ops.linear_int4(out, x, kquant.qweight, kquant.scales, 32, kquant.offsets, kquant.superblocks)
    _check_kernel(out, x, kquant)
    q6_k = _q6_k(37, 512, gen)
    ops.linear_int8(out, x, q6_k.qweight, q6_k.scales, 16, q6_k.superblocks)
    _check_kernel(out, x, q6_k)
    x = _activations(5, 40, seed=1)
    rounded = torch.empty_like(x)
    ops.round_activations(rounded, x)
    assert torch.equal(rounded, q.round_activations(x))


def test_native_kernel_builds_here():
    """CI machines have a compiler: a silent fallback to the slow path would hide a build break."""
    assert q.native_available(), q.native_build.unavailable_reason(q._SOURCE, q._WHAT)


def test_quantized_layer_keeps_no_full_precision_copy():
    layer = Linear(64, [32, 32], True, torch.float32, CPU)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(5, 64)
    reference = q.reference_linear(x, q.quantize(layer.weight, "int4")) + layer.bias
    layer.quantize("int4")
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.float32
    assert layer.weight_nbytes == 64 * 32 + 64 * 2 * 2  # half a byte per weight + one bf16 scale per 32
    layer.pack_for_onednn(batch_hint=64)  # a quantized layer stays quantized
    torch.testing.assert_close(layer(x), reference, atol=1e-4, rtol=1e-5)


def _head(vocab: int, hidden: int, tied: bool, seed: int) -> tuple[LMHead, VocabEmbedding, torch.Tensor]:
    """(head, embedding, the weight both started with)."""
    embedding = VocabEmbedding(vocab, hidden, torch.float32, CPU)
    head = LMHead(vocab, hidden, torch.float32, CPU, tied_embedding=embedding if tied else None)
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))
    embedding.weight.data.copy_(weight)
    head.weight.data.copy_(weight)
    return head, embedding, weight


@pytest.mark.parametrize("method", q.METHODS)
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_quantizes_to_int8_per_channel(method, tied):
    """Both methods give the head int8 per output channel; a tied embedding keeps its dense table."""
    head, embedding, weight = _head(97, 64, tied, seed=1)
    head.quantize(method)
    assert head._quantized.method == HEAD_METHOD == "int8" and head._quantized.group == 64
    assert head.weight_nbytes == 97 * 64 + 97 * 4  # a byte per weight + one fp32 scale per row
    assert head.weight.numel() == (97 * 64 if tied else 0)
    if tied:  # lookups still read the model-dtype table
        assert torch.equal(embedding.weight, weight)
    head.pack_for_onednn(batch_hint=64)  # a quantized head stays quantized
    for rows in (1, 40):  # the native kernel, then the tiled torch path
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        _check_kernel(head(x), x, q.quantize(weight, "int8"))
    with pytest.raises(ValueError, match="Unknown quantization 'int2'; supported: int8, int4"):
        _head(97, 64, tied, seed=1)[0].quantize("int2")


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_loaded_packed(tied):
    """A head stored quantized (GGUF's output.weight, or token_embd.weight when tied) stays packed;
    the embedding's lookup table gets its dequantized values."""
    head, embedding, _ = _head(97, 64, tied, seed=2)
    stored = q.quantize(torch.randn(97, 64, generator=torch.Generator().manual_seed(3)), "int4")
    target = embedding.weight if tied else head.weight  # where the checkpoint name maps
    target.weight_loader(target, stored)
    assert head._quantized is stored and head.weight_nbytes == stored.nbytes
    if tied:
        assert torch.equal(embedding.weight, stored.dequantize())
    else:
        assert head.weight.numel() == 0
        embedding.weight.weight_loader(embedding.weight, stored)  # an untied embedding stored quantized
        assert torch.equal(embedding.weight, stored.dequantize())
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    _check_kernel(head(x), x, stored)
    head.quantize("int8")  # --quantization keeps what the file stored
    assert head._quantized is stored
    with pytest.raises(ValueError, match=r"the LM head expects \(97, 64\), the checkpoint has \(96, 64\)"):
        wrong = _head(97, 64, tied, seed=2)[0]
        wrong.weight.weight_loader(wrong.weight, q.quantize(torch.randn(96, 64), "int8"))


def _on_grid(src: str, dst: str, grid: str) -> str:
    """A copy of the checkpoint whose linear weights are dequantize(quantize(w)) (`grid` a method),
    or GGUF Q4_1 dequantized (`grid` "q4_1", as the packaged default model is: int4 keeps that grid),
    the LM head's in per-channel int8 (the head's format under every method)."""
    def on_grid(w: torch.Tensor, grid: str) -> torch.Tensor:
        if grid != "q4_1":
            return q.quantize(w, grid).dequantize()
        raw = gguf.quants.quantize(w.float().numpy(), GGMLQuantizationType.Q4_1)
        return torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_1))

    model = load_hf_model(src)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(on_grid(module.weight, HEAD_METHOD if name == "lm_head" else grid))
    model.save_pretrained(dst)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def _round_linear_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """The quantized layers' activation rounding on a transformers / PEFT model: every base linear
    and the LM head (not PEFT's full-precision lora_A / lora_B) sees round_activations(x)."""
    def hook(module, args):
        x = args[0]
        return (q.round_activations(x.reshape(-1, x.shape[-1])).view_as(x).to(x.dtype),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
            module.register_forward_pre_hook(hook)
    return model


# Checkpoints on each method's grid, and on GGUF Q4_1's, which int4 keeps (its minimums in the kernel).
GRIDS = {"int8": "int8", "int4": "int4", "q4_1": "int4"}  # grid -> the --quantization that runs it


@pytest.fixture(scope="module")
def grid_checkpoints(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("on_grid")
    return {grid: _on_grid(checkpoints["llama"], str(root / grid), grid) for grid in GRIDS}


@pytest.mark.parametrize("grid", list(GRIDS))
def test_engine_on_grid_weights_matches_transformers_and_peft(grid, grid_checkpoints, tokenizer, tmp_path):
    base, method = grid_checkpoints[grid], GRIDS[grid]
    adapter = make_adapter(base, str(tmp_path / "lora"), ["q_proj", "v_proj", "down_proj"], r=8, seed=5)
    llm = LLM(base, max_model_len=256, quantization=method, enable_lora=True, max_loras=1, max_lora_rank=8,
              dtype="float32")
    linears = [m for m in llm.llm_engine.engine_core.runner.model.modules() if isinstance(m, Linear)]
    assert all((w.offsets is not None) == (grid == "q4_1") for m in linears for w in m.quantized_weights())
    hf, peft = _round_linear_inputs(load_hf_model(base)), _round_linear_inputs(load_peft_model(base, adapter))
    for text in ["What is the capital of France?", "one two three four five six seven eight " * 3]:
        ids = tokenizer.encode(text)
        _check_rounded_reference(generate_one(llm, ids), hf_greedy(hf, ids, 10))
        _check_rounded_reference(generate_one(llm, ids, LoRARequest("lora", 1, adapter)), hf_greedy(peft, ids, 10))


def test_quantized_kernel_is_built_with_the_model(grid_checkpoints, monkeypatch):
    """The model loader builds (or loads) the kernel, so the first request does not pay for it."""
    from tests.model_executor.configs import model_config_for
    from vllm.model_executor import model_loader

    calls = []
    monkeypatch.setattr(q, "native_available", lambda: calls.append(1) or True)
    model_loader.get_model(model_config_for(grid_checkpoints["int4"], quantization="int4"), CPU)
    assert calls


@pytest.mark.parametrize("grid", ["int4", "q4_1"])
def test_tensor_parallel_quantized_matches_one_rank(grid, grid_checkpoints):
    """Two ranks quantize their own rows (the head: its vocabulary block; a kept Q4_1 grid's scales
    and minimums with them) and give one rank's tokens."""
    prompts = ["hello world how are you", "one two three four five six seven eight"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = dict(max_model_len=128, quantization="int4", dtype="float32")
    single = LLM(grid_checkpoints[grid], **engine)
    reference = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    head = single.llm_engine.engine_core.runner.model.lm_head
    assert head._quantized is not None and head.weight.numel() == 0
    double = LLM(grid_checkpoints[grid], tensor_parallel_size=2, **engine)
    try:
        assert [o.outputs[0].token_ids for o in double.generate(prompts, params, use_tqdm=False)] == reference
    finally:
        double.llm_engine.engine_core.shutdown()


def _check_rounded_reference(out, ref) -> None:
    """Greedy tokens identical, logprobs within 5e-2. Usually they agree to 1e-6; the exception is an
    activation that fp32 summation order puts on the other side of a rounding tie: it moves by a
    whole step (1/127 of its block's largest value), and every later token by up to ~2e-2 (about
    one sequence in four on these tiny models). The tight checks are the kernel tests above."""
    tokens, logprobs = ref
    completion = out.outputs[0]
    assert completion.token_ids == tokens
    ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 5e-2


def test_bad_quantization_and_prequantized_checkpoints_are_refused(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="--quantization 'gptq' is not supported; supported: int8, int4"):
        LLM(checkpoints["llama"], quantization="gptq")
    path = str(tmp_path / "gptq")
    shutil.copytree(checkpoints["llama"], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: quantized checkpoints are not supported "
                                         r"\(quantization_config has quant_method='gptq'\).*--quantization int8 or int4"):
        LLM(path, max_model_len=64)


needs_tiles = pytest.mark.skipif(q.native_available() and q.tile_rows() == 0,
                                 reason="the native kernel's int4 row tiles need AVX512-VNNI")


def _tile_forms(n: int, k: int, gen: torch.Generator) -> dict[str, q.QuantizedWeight]:
    """Each form `tile` takes: int4 symmetric with bf16 scales (at load), GGUF Q4_0's fp16 scales, GGUF
    Q4_1's fp16 scales with fp16 mins beside them, GGUF Q4_K's two-level form; int8 per channel (at
    load), GGUF Q8_0's (fp16 d per 32, the full int8 range, -128 included) and Q6_K's two-level form
    (the K-quants where K % 256 == 0)."""
    sym = q.quantize(torch.randn(n, k, generator=gen), "int4")
    scales, mins = q.q4_1_scales_and_mins(sym.scales.half(), (torch.randn(n, k // 32, generator=gen) / 20).half())
    q8_0 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return {"bf16": sym, "q4_0": q.QuantizedWeight("int4", sym.qweight, sym.scales.half(), 32, k),
            "q4_1": q.QuantizedWeight("int4", sym.qweight, scales, 32, k, mins),
            "int8": q.quantize(torch.randn(n, k, generator=gen), "int8"),
            "q8_0": q.QuantizedWeight("int8", q8_0, (torch.rand(n, k // 32, generator=gen) / 100).half(), 32, k),
            **({"q4_k": _kquant(n, k, gen), "q6_k": _q6_k(n, k, gen)} if k % 256 == 0 else {})}


@needs_tiles
@pytest.mark.parametrize("rows", [1, 2, 5, 70, 2100])  # 2100: past the row layout's native limit, still native
@pytest.mark.parametrize(("form", "k"), [(form, k) for form in ("bf16", "q4_0", "q4_1", "q4_k", "int8", "q8_0", "q6_k")
                                         for k in (64, 576, 1536) if form not in ("q4_k", "q6_k") or k % 256 == 0])
def test_row_tiles_equal_reference(form, rows, k):
    """A weight `tile` lays out in row tiles computes reference_linear (fp32 and bf16 x), holds the
    row layout's bytes (`untile` gives them back bit for bit; dequantize reads the tiles), and runs
    the same kernel entry from Python and from the native decoder layer (linear_int4)."""
    gen = torch.Generator().manual_seed(rows + k)
    weight = _tile_forms(48, k, gen)[form]
    tiled = q.tile(weight)
    block_bytes = 256 if weight.method == "int4" else 512
    assert tiled.tiled and tiled.qweight.shape == (3, k // 32, block_bytes) and tiled.out_features == 48
    assert tiled.nbytes == weight.nbytes
    back = q.untile(tiled)
    for a, b in zip(back.tensors(), weight.tensors()):
        assert torch.equal(a, b)
    assert torch.equal(tiled.dequantize(slice(5, 40)), weight.dequantize(slice(5, 40)))
    x = torch.randn(rows, k, generator=gen)
    assert q._runs_native(x, tiled)
    _check_kernel(q.quantized_linear(x, tiled, None), x, weight)
    out = torch.empty(rows, 48, dtype=torch.bfloat16)
    q._native_linear(out, x.bfloat16(), tiled)  # linear_int4 / linear_int8, as the native decoder layer calls them
    assert torch.equal(out, q.quantized_linear(x.bfloat16().float(), tiled, None).bfloat16())


@needs_tiles
def test_row_tiles_give_a_row_the_same_result_in_any_batch_or_thread_count():
    """Four tiles read side by side for one row of x, four rows of x sharing each unpacked block for
    several: a row's output is bitwise the same alone, in any batch, and on 1 or 2 threads."""
    gen = torch.Generator().manual_seed(5)
    for weight in [*_tile_forms(16 * 37, 576, gen).values(), _kquant(16 * 37, 512, gen), _q6_k(16 * 37, 512, gen)]:
        tiled, x = q.tile(weight), torch.randn(11, weight.in_features, generator=gen)
        one, two = on_thread_counts(lambda: q.quantized_linear(x, tiled, None))
        assert torch.equal(one, two)
        for rows in (1, 2, 4, 5, 11):
            batched = q.quantized_linear(x[:rows], tiled, None)
            for i in sorted({0, rows - 1}):
                assert torch.equal(q.quantized_linear(x[i:i + 1], tiled, None), batched[i:i + 1])
                assert torch.equal(batched[i], one[i])


@needs_tiles
def test_tile_takes_only_what_the_kernel_reads_and_layers_hold_tiles():
    """Weights the tiles cannot hold stay in the row layout: rows not a multiple of 16, int8 in groups
    other than 32 and K, int4 with fp32 scales or offsets; tiled slices stack in
    the row layout. A quantized Linear holds its weight tiled."""
    gen = torch.Generator().manual_seed(7)
    sym = q.quantize(torch.randn(40, 256, generator=gen), "int4")
    kept = [q.quantize(torch.randn(40, 256, generator=gen), "int4").rows(slice(0, 33)),
            q.quantize(torch.randn(40, 256, generator=gen), "int8").rows(slice(0, 33)),
            _weight("int8", 48, 256, 64, gen), _weight("int8", 48, 256, 16, gen),
            q.QuantizedWeight("int4", sym.qweight[:32], sym.scales[:32].float(), 32, 256),
            q.QuantizedWeight("int4", sym.qweight[:32], sym.scales[:32], 32, 256, torch.zeros(32, 8))]
    for weight in kept:
        assert q.tile(weight) is weight
    a, b = (q.quantize(torch.randn(rows, 256, generator=gen), "int4") for rows in (32, 16))
    for x, y in zip(q.stack_rows([q.tile(a), q.tile(b)]).tensors(), q.stack_rows([a, b]).tensors()):
        assert torch.equal(x, y)  # tiled slices stack in the row layout
    layer = Linear(256, [48, 16], False, torch.float32, CPU)
    layer.weight.data.copy_(torch.randn(64, 256, generator=gen))
    dense = layer.weight.detach().clone()
    layer.quantize("int4")
    (held,) = layer.quantized_weights()
    assert held.tiled and torch.equal(q.untile(held).qweight, q.quantize(dense, "int4").qweight)
    x = torch.randn(3, 256, generator=gen)
    _check_kernel(layer(x), x, q.untile(held))


@needs_tiles
def test_tiled_kernel_refuses_mismatched_tensors():
    forms = _tile_forms(32, 64, torch.Generator().manual_seed(1))
    weight, int8 = q.tile(forms["q4_1"]), q.tile(forms["q8_0"])
    x, out = torch.randn(1, 64), torch.empty(1, 32)
    with pytest.raises(RuntimeError, match="tiled int4 scales must be"):
        torch.ops.vllm_quant.linear_int4(out, x, weight.qweight, weight.scales[:, :1], 32, weight.offsets)
    with pytest.raises(RuntimeError, match="tiled int4 offsets must be fp16 mins"):
        torch.ops.vllm_quant.linear_int4(out, x, weight.qweight, weight.scales, 32, weight.offsets.float())
    with pytest.raises(RuntimeError, match=r"tiled weights are contiguous \[N / 16, K / 32, 256\]"):
        torch.ops.vllm_quant.linear_int4(out, torch.randn(1, 96), weight.qweight, weight.scales, 32, weight.offsets)
    with pytest.raises(RuntimeError, match="tiled int8 scales must be"):
        torch.ops.vllm_quant.linear_int8(out, x, int8.qweight, int8.scales.bfloat16(), 32)
    q6_k = q.tile(_q6_k(32, 256, torch.Generator().manual_seed(2)))
    x6, out6 = torch.randn(1, 256), torch.empty(1, 32)
    with pytest.raises(RuntimeError, match="tiled Q6_K sc must be int8"):
        torch.ops.vllm_quant.linear_int8(out6, x6, q6_k.qweight, q6_k.scales[:, :-1], 16, q6_k.superblocks)
    with pytest.raises(RuntimeError, match="tiled Q6_K superblocks must be contiguous fp32"):
        torch.ops.vllm_quant.linear_int8(out6, x6, q6_k.qweight, q6_k.scales, 16, q6_k.superblocks.squeeze(2))


@needs_tiles
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_holds_row_tiles(tied):
    """A quantized head whose vocabulary is a multiple of 16 rows is held in the kernel's row tiles, at
    load and when the file stored it quantized, and computes the row layout's reference at one row and
    at many."""
    head, _, weight = _head(96, 64, tied, seed=6)
    head.quantize("int4")
    assert head._quantized.tiled and torch.equal(q.untile(head._quantized).qweight, q.quantize(weight, "int8").qweight)
    stored = q.quantize(torch.randn(96, 64, generator=torch.Generator().manual_seed(7)), "int8")
    loaded, embedding, _ = _head(96, 64, tied, seed=6)
    target = embedding.weight if tied else loaded.weight
    target.weight_loader(target, stored)
    assert loaded._quantized.tiled and loaded.weight_nbytes == stored.nbytes
    for rows in (1, 40):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        _check_kernel(head(x), x, q.quantize(weight, "int8"))
        _check_kernel(loaded(x), x, stored)
