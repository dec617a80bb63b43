"""Dense linear layers on the CPU for few rows (decodes, short chunks): the native GEMV of
vllm/csrc/cpu/dense_gemv.cpp, which reads every weight byte once per call at close to the
machine's copy bandwidth; `dense_linear` is the one entry point and holds the dispatch rule.

Semantics (the kernel's header states them in full):
    out = x @ W.T (+ bias), x and W widened to fp32 (a bf16 weight exactly, by a shift), fp32
    accumulation in a fixed order per output element, returned in x's dtype. `reference_linear`
    computes the same in float64.

When it runs (`dense_linear`): on the CPU, for at most `native_max_rows(weight.dtype)` rows of x
(16; 8 for fp32 on AVX-512 CPUs, whose oneDNN matmuls catch up sooner; for bf16 none where the
CPU has AVX512-BF16 and 2 where it has other native bf16), an fp32 or bf16 weight stored plain
row-major [N, K] (not oneDNN-packed), once the kernel is built, and not under
VLLM_USE_TORCH_REFERENCE_OPS. bf16 rows past those, up to BF16_DOT_MAX_ROWS, run
vllm/csrc/cpu/bf16_dot_linear.cpp where the CPU has AVX512-BF16 (`uses_bf16_dot`: bf16 x and
weight, bf16 products summed in fp32 by vdpbf16ps, bf16 out): there every bf16 decode.
Wherever the kernel is built, fp32 and bf16 weights stay row-major on the CPU and serve every
path (platforms.py `use_onednn_linear`). Many rows (prefills) run `many_rows_linear`: fp32 on oneDNN reading the plain weight where the CPU has AVX-512 (MKL's
sgemm there ran 2.2x slower: it keeps to AVX2 on AMD), F.linear elsewhere (MKL, as fast as oneDNN
on AVX2 CPUs); bf16 F.linear (oneDNN's bf16 matmul) where the CPU has native bf16, and where it
does not (F.linear would emulate bf16 element by element) fp32 products on weight tiles widened
exactly, rounded to bf16 once (`widened_linear`), as fast as an fp32 prefill. CUDA, other dtypes
and the reference path run F.linear.

Invariants:
  - The weight is read where it lives: no copy, no second layout, so a tied LM head reads the
    embedding table itself and a tensor-parallel rank its own rows or columns.
  - The kernel's result for a row of x depends neither on the thread count nor on how many rows
    share the call: a token decoded alone or in a batch of decodes gets bitwise the same logits.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from vllm import envs, native_build

# Up to this many rows of x run the native kernel. Measured on a 2-core AVX2 EPYC (fp32, one
# thread, CPU time): 1 row as fast as MKL's sgemv and up to 1.7x faster than oneDNN's packed
# weights (4096x4096: 4.3 ms, sgemv 4.4, oneDNN 7.2); 2-8 rows 1.2-4x faster than F.linear on
# every SmolLM2-135M and Granite-8B shape (oneDNN: faster on some small ones); at 16 rows still
# 2x faster on Granite's shapes and 1.3x on SmolLM2's LM head, the biggest part of its step, but
# 1.3x slower on its small cache-resident layers; at 32 and beyond F.linear wins on most shapes.
# Where oneDNN has wider vectors or native bf16, it catches up sooner: `native_max_rows`.
NATIVE_MAX_ROWS = 16
# bf16 rows past native_max_rows up to which the vdpbf16ps kernel (bf16_dot_linear.cpp) runs where
# the CPU has AVX512-BF16, rather than oneDNN's bf16 matmul (which reorders the plain weight on
# every call). Measured one thread on an AVX-512 EPYC, the linears of SmolLM2's 30 layers with
# weights beyond cache: 5 / 8 / 16 rows 10.3 / 13.0 / 18.4 ms against oneDNN's 16.4 / 18.1 / 21.7
# and the GEMV's 17.2 / 20.4 / 33.1; even with oneDNN at 32 (30 ms each). (The host's memory
# bandwidth swings with its neighbours: in later runs with the kernel's prefetch 8 / 16 rows took
# 12.4-13.7 / 17.3-19.4 ms where the kernel without it took 20-23 / 23-24.) From 3 rows it also
# beats the GEMV (9.6 ms against 11.3; with its asks into L2, on a Zen 4 EPYC, 14-17 GB/s against
# the GEMV's 9-15 at 4 rows, even at 2-3), so native_max_rows leaves it every bf16 row past 2, and
# the native decoder layers run it too (`layer_rows`).
BF16_DOT_MAX_ROWS = 32
WIDEN_TILE_ROWS = 1024  # output rows of a bf16 weight widened to fp32 at once (many-row path)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
_SOURCE, _WHAT = "dense_gemv.cpp", "CPU dense GEMV kernel"
_BF16_DOT_SOURCE, _BF16_DOT_WHAT = "bf16_dot_linear.cpp", "CPU bf16 dot-product linear kernel"


def native_available() -> bool:
    return native_build.unavailable_reason(_SOURCE, _WHAT) is None


@functools.cache
def native_max_rows(dtype: torch.dtype) -> int:
    """Rows of x up to which a `dtype` weight runs the kernel. Measured one thread on an AVX-512
    EPYC with native bf16, a SmolLM2 step's linears against `many_rows_linear` (oneDNN on the
    plain weight): fp32 1.46x / 1.18x faster at 4 / 8 rows, 0.88x / 0.86x at 12 / 16; bf16 1.17x
    faster at 4 rows, 0.86x at 8, 0.62x at 16. Where the vdpbf16ps kernel runs, bf16 takes it at
    every row count (0 here): its strided tiles read SmolLM2's weights 1.03-1.15x faster than this
    kernel even at one row (bf16_dot_linear.cpp's header); elsewhere with native bf16, 2.
    NATIVE_MAX_ROWS elsewhere (AVX2: the header)."""
    if dtype == torch.bfloat16 and not bf16_matmul_emulated():
        return 0 if bf16_dot_available() else 2
    if dtype == torch.float32 and onednn_fp32_preferred():
        return 8
    return NATIVE_MAX_ROWS


def uses_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The dispatch rule of `dense_linear` (the module docstring's "When it runs"). Per call on
    every decode linear: the cheap tests first, the environment and the build last."""
    return (x.dtype in WEIGHT_DTYPES and weight.dtype in WEIGHT_DTYPES and x.is_cpu and weight.is_cpu
            and weight.dim() == 2 and weight.is_contiguous()
            and x.numel() <= native_max_rows(weight.dtype) * x.shape[-1]
            and not envs.VLLM_USE_TORCH_REFERENCE_OPS and native_available())


@functools.cache
def bf16_dot_available() -> bool:
    """Whether the vdpbf16ps kernel runs here: built (first call) only where the CPU has AVX512-BF16."""
    from vllm.platforms import cpu_has_avx512_bf16

    return cpu_has_avx512_bf16() and native_build.unavailable_reason(_BF16_DOT_SOURCE, _BF16_DOT_WHAT) is None


def layer_rows(weight: torch.Tensor) -> tuple[int, int]:
    """(rows up to which a native decoder layer runs this dense weight's linear, rows above which
    it runs the vdpbf16ps kernel rather than the GEMV: -1 for never), as dense_linear dispatches."""
    if weight.dtype == torch.bfloat16 and bf16_dot_available():
        gemv_rows = native_max_rows(weight.dtype)
        return max(gemv_rows, min(BF16_DOT_MAX_ROWS, NATIVE_MAX_ROWS)), gemv_rows
    return native_max_rows(weight.dtype), -1


def uses_bf16_dot(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The vdpbf16ps kernel's rule: bf16 x and plain bf16 weight on the CPU, up to BF16_DOT_MAX_ROWS
    rows (`dense_linear` asks after `uses_native`), the kernel built."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.is_cpu and weight.is_cpu and weight.dim() == 2
            and weight.is_contiguous() and x.numel() <= BF16_DOT_MAX_ROWS * x.shape[-1]
            and not envs.VLLM_USE_TORCH_REFERENCE_OPS and bf16_dot_available())


def bf16_dot_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The vdpbf16ps kernel on bf16 x [..., K] and a contiguous bf16 weight [N, K]: [..., N] bf16
    (its semantics: bf16_dot_linear.cpp's header)."""
    n, k = weight.shape
    xf = x.reshape(-1, k).contiguous()
    out = torch.empty(xf.shape[0], n, dtype=torch.bfloat16)  # [M, N]
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    torch.ops.vllm_bf16_dot.bf16_dot_linear(out, xf, weight, bias)
    return out.view(*x.shape[:-1], n)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel on x [..., K] against a contiguous weight [N, K]: [..., N] in x's dtype. Bad
    shapes or dtypes raise ValueError before any work."""
    if weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight must be a 2-D fp32 or bf16 tensor [N, K], got {weight.dtype} "
                         f"of shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must end in the weight's {k} input features, got shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    return _gemv(x, weight.contiguous(), bias)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """native_linear past its checks (weight contiguous). It runs on every decode linear, where
    Python cost the kernel's time again: each conversion and view only when it changes something."""
    n, k = weight.shape
    xf = x if x.dim() == 2 else x.reshape(-1, k)
    if xf.dtype not in WEIGHT_DTYPES:  # the kernel takes fp32 and bf16 x as they are
        xf = xf.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    out = torch.empty(xf.shape[0], n, dtype=xf.dtype)  # [M, N]
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    torch.ops.vllm_dense.dense_gemv(out, xf, weight, bias)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], n)
    return out if out.dtype == x.dtype else out.to(x.dtype)


@functools.cache
def bf16_matmul_emulated() -> bool:
    """Whether this CPU lacks native bf16 matmuls (oneDNN packs bf16 exactly where it has them)."""
    from vllm.platforms import onednn_packs

    return not onednn_packs(torch.bfloat16)


def uses_widened(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Many rows of bf16 on a CPU without native bf16: torch would emulate the bf16 matmul
    element by element (about 6x slower than fp32 on 2,048 rows)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and x.dtype == weight.dtype == torch.bfloat16 and not envs.VLLM_USE_TORCH_REFERENCE_OPS
            and bf16_matmul_emulated())


@functools.cache
def onednn_fp32_preferred() -> bool:
    """Whether many-row fp32 matmuls run on oneDNN rather than MKL's sgemm: on CPUs with AVX-512,
    where oneDNN (reading the plain weight) measured 2.2x faster on SmolLM2's 2,048-row shapes
    (AMD EPYC with AVX-512: MKL keeps to AVX2 there); on AVX2 CPUs the two measured the same."""
    from vllm.platforms import cpu_has_avx512, onednn_packs

    return cpu_has_avx512() and onednn_packs(torch.float32)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear of fp32 x and weight (plain [N, K]) on the faster of MKL and oneDNN here
    (`onednn_fp32_preferred`); the reference path keeps F.linear."""
    if x.is_cpu and onednn_fp32_preferred() and not envs.VLLM_USE_TORCH_REFERENCE_OPS:
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN's linear on a weight pre-packed for it (linear.py's `pack_onednn_weight`) or on a
    plain one [N, K] (which it reorders as it needs per call)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear in fp32 on x and WIDEN_TILE_ROWS output rows of the weight at a time, widened
    exactly from bf16 (the temporary stays a few MiB), rounded to bf16 once at the end: what
    an fp32 prefill costs, plus the widening."""
    xf = x.float()  # [..., K]
    out = torch.cat([fp32_linear(xf, weight[start:start + WIDEN_TILE_ROWS].float(), None)
                     for start in range(0, weight.shape[0], WIDEN_TILE_ROWS)], dim=-1)  # [..., N] fp32
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def many_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, weight, bias) past the native kernel's rows: bf16 widened to fp32 where the CPU
    would emulate it (`uses_widened`), fp32 on `fp32_linear`, anything else F.linear."""
    if uses_widened(x, weight):
        return widened_linear(x, weight, bias)
    if x.dtype == weight.dtype == torch.float32:
        return fp32_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias): few rows on the native kernel (`uses_native`), a few dozen bf16
    rows on the vdpbf16ps kernel (`uses_bf16_dot`), many rows on `many_rows_linear`."""
    if uses_native(x, weight):
        return _gemv(x, weight, bias)
    if uses_bf16_dot(x, weight):
        return bf16_dot_linear(x, weight, bias)
    return many_rows_linear(x, weight, bias)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the kernel computes, in float64 (x and weight widened exactly), returned as fp32."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()
