"""benchmarks/triton_aot.py: the CI run of the ahead-of-time compile check (--ci: the full
matrix for sm_80 and sm_90 through the committed record, compiling every kernel and every
constexpr branch once per arch and comparing them with it), the record's rules, and the
checks that keep the kernel list and launch tables in step with the engine's code."""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks import triton_aot, triton_aot_record

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


def _run_aot(*args: str) -> subprocess.CompletedProcess:
    """The script for real targets (ptxas): without the interpreter, in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_aot.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_committed_record_vouches_for_the_full_matrix():
    """Every launched specialization on both targets is in the record with its kernel's
    current source key, and passes: regenerate with --update-record after a kernel change."""
    specs = triton_aot.launched_specs(quick=False)
    record = triton_aot_record.load()
    vouched, fresh, missing = triton_aot.plan_ci(specs, triton_aot.launched_specs(True), [80, 90], record,
                                                 triton_aot.kernel_sources())
    assert missing == 0, "run `python benchmarks/triton_aot.py --update-record` and commit the record"
    assert len(vouched) == 2 * len(specs)
    bad = [(s.kernel, s.dtype, s.label(), a) for s, a, r in vouched if triton_aot.verdict(r, a, s.dtype).startswith("FAIL")]
    assert not bad
    assert len(fresh) == 2 * len(triton_aot.launched_specs(True))  # only the sample is compiled


def test_ci_mode_compiles_the_sample_and_checks_it_against_the_record():
    pytest.importorskip("triton.backends.nvidia")
    proc = _run_aot("--ci", "--arch", "80", "90")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "specializations from the record" in proc.stdout
    for kernel in triton_aot.KERNELS:
        assert f"| `{kernel}` |" in proc.stdout
    assert "FAIL" not in proc.stdout


def test_ci_mode_fails_naming_the_command_when_the_record_lacks_too_much(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    proc = _run_aot("--ci", "--record", str(tmp_path / "empty.json"), "--max-fresh", "10")
    assert proc.returncode == 1
    assert "--update-record" in proc.stdout and "not vouched for" in proc.stdout


_KERNEL_MODULE = """
import triton
import triton.language as tl

SCALE = {scale}
UNUSED = 1


@triton.jit
def _helper(x):
    return x * {factor}


@triton.jit
def kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, _helper(tl.load(x_ptr + offs)) * SCALE)


def python_code_elsewhere():
    return {elsewhere}
"""


def _key(tmp_path, name: str, **values) -> str:
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(_KERNEL_MODULE.format(**{"scale": 2, "factor": 3, "elsewhere": 0, **values}))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return triton_aot_record.source_key(module.kernel)


def test_source_key_follows_the_kernel_its_helpers_and_constants_only(tmp_path):
    base = _key(tmp_path, "k0")
    assert _key(tmp_path, "k1") == base  # same code in another module
    assert _key(tmp_path, "k2", elsewhere=5) == base  # code the kernel does not reach
    assert _key(tmp_path, "k3", factor=4) != base  # a helper it calls
    assert _key(tmp_path, "k4", scale=5) != base  # a global constant it reads


def test_record_entry_disagreement():
    entry = dict(reg=100, local=0, stack=0, smem=1024, warps=4)
    assert triton_aot_record.disagreement(entry, dict(entry, seconds=1.0)) is None
    assert triton_aot_record.disagreement(entry, dict(entry, reg=120)) == "reg 100 -> 120"
    assert "now CompilationError" in triton_aot_record.disagreement(entry, {"error": "CompilationError: x"})
