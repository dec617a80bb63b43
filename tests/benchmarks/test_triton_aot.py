"""benchmarks/triton_aot.py: the CI run of the ahead-of-time compile check (--quick: every
kernel and every constexpr branch once per arch, for sm_80 and sm_90), and the checks that
keep its kernel list and launch tables in step with the engine's code."""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks import triton_aot

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _jit_functions() -> set[str]:
    names = set()
    for path in (ROOT / "vllm").rglob("*.py"):
        names.update(re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+)", path.read_text()))
    return names


def test_every_triton_kernel_is_checked():
    """A new @triton.jit function must be added to KERNELS (launched), HELPERS (inlined) or,
    until its launcher has a launch table, NOT_CHECKED (printed by every run)."""
    assert _jit_functions() == set(triton_aot.KERNELS) | triton_aot.HELPERS | set(triton_aot.NOT_CHECKED)


def test_launch_tables_name_the_kernel_constexprs():
    """Each launch table gives exactly the kernel's constexpr parameters (plus num_warps /
    num_stages), and the full matrix covers every kernel and both sides of each branch."""
    import importlib

    import triton.language as tl

    specs = triton_aot.launched_specs(quick=False)
    for kernel, (module, _) in triton_aot.KERNELS.items():
        fn = getattr(importlib.import_module(module), kernel)
        params = inspect.signature(getattr(fn, "fn", fn)).parameters.values()
        constexprs = {p.name for p in params if p.annotation in (tl.constexpr, "tl.constexpr")}
        mine = [dict(s.launch) for s in specs if s.kernel == kernel]
        assert mine, kernel
        for launch in mine:
            assert set(launch) - {"num_warps", "num_stages"} == constexprs, kernel
    values = lambda kernel, key: {dict(s.launch)[key] for s in specs if s.kernel == kernel}  # noqa: E731
    assert values("_decode_kernel", "NUM_SPLITS") >= {1, 2, 16}
    assert values("_rms_norm_kernel", "HAS_RESIDUAL") == {False, True}
    assert values("_sgmv_shrink_kernel", "SPLIT_K") >= {1, 2, 16}
    assert values("_bgmv_shrink_kernel", "BLOCK_R") == {16, 32, 64}
    assert values("_prefill_kernel", "DOT_PRECISION") == {"ieee", "tf32"}
    for kernel in ("_decode_kernel", "_prefill_kernel"):  # attention variants: every flag both ways
        for flag in ("SLIDING_WINDOW", "SOFT_CAP", "HAS_SINKS"):
            assert values(kernel, flag) == {False, True}, (kernel, flag)
    assert values("_grouped_matmul_kernel", "DOT_PRECISION") == {"ieee", "tf32"}


def test_verdict_flags_spills_and_shared_memory():
    ok = dict(reg=128, local=0, stack=0, smem=48 * 1024, warps=4)
    assert triton_aot.verdict(ok, 80) == "ok"
    assert triton_aot.verdict({**ok, "local": 8}, 90) == "FAIL spill"
    assert not triton_aot.verdict({**ok, "local": 8}, 90, "fp32").startswith("FAIL")
    assert triton_aot.verdict({**ok, "smem": 200 * 1024}, 80) == "FAIL smem"
    assert triton_aot.verdict({**ok, "smem": 200 * 1024}, 90) == "ok"
    assert triton_aot.verdict({**ok, "reg": 255, "warps": 16}, 90) == "FAIL regs"
    assert triton_aot.verdict({"error": "CompilationError: x"}, 90) == "FAIL compile"


def test_quick_compile_for_sm80_and_sm90():
    """Compiles for real targets (ptxas), so it runs without the interpreter, in a subprocess."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_aot.py"), "--quick", "--arch", "80", "90"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for kernel in triton_aot.KERNELS:
        assert f"\n{kernel}\n" in proc.stdout
    assert "FAIL" not in proc.stdout
