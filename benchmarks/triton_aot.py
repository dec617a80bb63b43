"""Ahead-of-time compile check: every Triton kernel of the engine compiled for real NVIDIA
targets (sm_80, sm_90) on a machine without a GPU, with its resource usage.

    python benchmarks/triton_aot.py                  # full matrix, sm_80 and sm_90, every row printed
    python benchmarks/triton_aot.py --arch 90        # one target
    python benchmarks/triton_aot.py --quick          # every kernel and constexpr branch once per arch
    python benchmarks/triton_aot.py --update-record  # full matrix -> triton_aot_record.json + docs/triton_aot.md
    python benchmarks/triton_aot.py --ci             # full matrix through the record (CI, gpu_check.sh)

What it owns: the list of launched specializations (built by calling each kernel module's
*_launch function, the same table its launcher passes to the kernel, never a copy) and the
pass/fail verdict. The triton wheel ships the NVIDIA backend and ptxas, so
triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32)) runs the whole pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin) here; cuobjdump reads registers and local memory
(spills) from the cubin, the kernel metadata gives the dynamic shared memory it launches with.

Invariants:
- KERNELS names every @triton.jit kernel the engine launches and HELPERS every @triton.jit
  function only called from them; tests/benchmarks/test_triton_aot.py fails when a new one
  appears in neither (nor in NOT_CHECKED, which the run prints as unchecked), so a new
  kernel cannot skip the check silently.
- Exit status 1 on any compile failure, any spill in a bf16/fp16 specialization (every
  kernel here runs per layer per step: all are hot), shared memory over the target's opt-in
  per-block limit, or a block needing more than the 64K registers of an SM. fp32
  specializations (the device kernel tests, --dtype float32) must compile and fit, but
  their spills are reported, not failed: fp32 is a checking dtype, not a serving one.
- Runtime ints (strides, sizes, block_size, LoRA col_offset) are compiled as i32 and pointers
  as 16-byte aligned, as the JIT specializes them on a GPU. Block size and the LoRA slice
  count (qkv 3, gate|up 2, single 1) are runtime values: one launch per slice with the same
  constexprs, so they add no specialization. An attention layer's variant (sliding window,
  soft cap, sinks) is three constexpr flags: the full matrix compiles all eight
  combinations, --quick none and all three.
- Compiled kernels are cached by triton itself (TRITON_CACHE_DIR, default ~/.triton/cache):
  a second run only re-reads the cubins. A clean CI machine has no such cache, so `--ci`
  takes the full matrix from the committed record (benchmarks/triton_aot_record.py says
  when an entry still vouches for a compile), compiles the --quick sample plus whatever the
  record lacks and fails when a fresh compile contradicts its entry.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import triton_aot_record as record_mod  # noqa: E402

# Max dynamic shared memory per block with opt-in (CUDA programming guide, compute capability
# table): sm_80 (A100) 163 KiB, sm_90 (H100/H200) 227 KiB. Registers: 64K per SM and block.
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
REGS_PER_BLOCK = 65536

# (name, hidden_size, num_heads, num_kv_heads, head_size) of the supported architectures'
# common checkpoints, and the tiny shapes tests/kernels launch on a device (fp32 included).
MODEL_SHAPES = (
    ("granite-3.3-8b", 4096, 32, 8, 128),
    ("granite-3.3-2b", 2048, 32, 8, 64),
    ("granite-4.0-micro", 2560, 40, 8, 64),
    ("llama-3.1-8b", 4096, 32, 8, 128),
    ("llama-3.2-3b", 3072, 24, 8, 128),
    ("llama-3.2-1b", 2048, 32, 8, 64),
    ("llama-2-7b", 4096, 32, 32, 128),
    ("mistral-7b", 4096, 32, 8, 128),
    ("qwen2.5-0.5b", 896, 14, 2, 64),
    ("qwen2.5-1.5b", 1536, 12, 2, 128),
    ("qwen2.5-7b", 3584, 28, 4, 128),
    ("qwen3-0.6b", 1024, 16, 8, 128),
    ("qwen3-8b", 4096, 32, 8, 128),
    ("phi-3-mini", 3072, 32, 32, 96),
    ("phi-4-mini", 3072, 24, 8, 128),
    ("gemma-2b", 2048, 8, 1, 256),
    ("gemma-2-2b", 2304, 8, 4, 256),
    ("gemma-2-9b", 3584, 16, 8, 256),
    ("gemma-2-27b", 4608, 32, 16, 128),
    ("gemma-3-1b", 1152, 4, 1, 256),
    ("gemma-3-12b", 3840, 16, 8, 256),
    ("olmoe-1b-7b", 2048, 16, 16, 128),
    ("gpt-oss-20b", 2880, 64, 8, 64),
)
LORA_RANKS = (8, 16, 32, 64)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUICK_SHAPE = ("granite-3.3-8b", 4096, 32, 8, 128)
# (name, hidden_size, moe_intermediate_size) of the supported MoE checkpoints: the experts'
# two matmuls are [2 * intermediate, hidden] and [hidden, intermediate].
MOE_SHAPES = (
    ("mixtral-8x7b", 4096, 14336),
    ("qwen3-30b-a3b", 2048, 768),
    ("granite-3.0-3b-a800m", 1536, 512),
    ("olmoe-1b-7b", 2048, 1024),
    ("gpt-oss-20b", 2880, 2880),
)

# kernel name -> (module, pointer element types other than the model dtype)
KERNELS = {
    "_decode_kernel": ("vllm.attention.ops.paged_attention",
                       dict(block_table_ptr="i32", seq_lens_ptr="i32", part_acc_ptr="fp32", part_ml_ptr="fp32",
                            sinks_ptr="fp32")),
    "_decode_reduce_kernel": ("vllm.attention.ops.paged_attention", dict(part_acc_ptr="fp32", part_ml_ptr="fp32")),
    "_prefill_kernel": ("vllm.attention.ops.paged_attention",
                        dict(block_table_ptr="i32", seq_lens_ptr="i32", query_start_loc_ptr="i32", sinks_ptr="fp32")),
    "_store_kv_kernel": ("vllm.attention.ops.kv_store", dict(slot_mapping_ptr="i64")),
    "_rms_norm_kernel": ("vllm.attention.ops.rms_norm", {}),
    "_rotary_kernel": ("vllm.attention.ops.rotary", dict(positions_ptr="i64")),
    "_sgmv_shrink_kernel": ("vllm.lora.ops.triton_ops", dict(
        h_ptr="fp32", sorted_ids_ptr="i64", seg_slots_ptr="i32", seg_starts_ptr="i32", seg_lens_ptr="i32")),
    "_sgmv_expand_kernel": ("vllm.lora.ops.triton_ops", dict(
        h_ptr="fp32", sorted_ids_ptr="i64", seg_slots_ptr="i32", seg_starts_ptr="i32", seg_lens_ptr="i32")),
    "_bgmv_shrink_kernel": ("vllm.lora.ops.triton_ops", dict(h_ptr="fp32", mapping_ptr="i32")),
    "_bgmv_expand_kernel": ("vllm.lora.ops.triton_ops", dict(h_ptr="fp32", mapping_ptr="i32")),
    "_grouped_matmul_kernel": ("vllm.model_executor.layers.fused_moe_triton",
                               dict(rows_ptr="i32", block_expert_ptr="i64")),
}
HELPERS = {"_attend_tile", "_rotate_heads"}  # inlined into the kernels above
# Kernels whose launcher has no *_launch table yet: listed so the run says they are unchecked.
NOT_CHECKED: dict[str, str] = {}
FLOAT_ARGS = {"scale_log2", "soft_cap_log2", "eps"}
_TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Spec:
    kernel: str
    dtype: str  # model dtype of the tensors that are not listed in KERNELS
    launch: tuple  # sorted (name, value) of the *_launch dict: constexprs and num_warps/num_stages
    source: str  # first model shape / parameter that needs it

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.launch if k not in ("num_warps", "num_stages"))


def _power_splits(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def launched_specs(quick: bool) -> list[Spec]:
    """Every distinct (kernel, dtype, launch table) the launchers produce for the shapes above."""
    from vllm.attention.ops import kv_store, paged_attention as pa, rms_norm, rotary
    from vllm.lora.ops import triton_ops as lo
    from vllm.model_executor.layers import fused_moe_triton as moe

    shapes = (QUICK_SHAPE,) if quick else MODEL_SHAPES
    dtypes = (torch.bfloat16,) if quick else DTYPES
    ranks = (16,) if quick else LORA_RANKS
    decode_splits = [1, 2] if quick else _power_splits(pa.MAX_DECODE_SPLITS)
    lora_splits = [1, 2] if quick else _power_splits(lo.MAX_SPLIT_K)
    combos = [(False,) * 3, (True,) * 3] if quick else list(itertools.product((False, True), repeat=3))
    variants = [dict(zip(pa.VARIANT_FLAGS, combo)) for combo in combos]
    moe_shapes = MOE_SHAPES[:1] if quick else MOE_SHAPES
    out: dict[tuple, Spec] = {}

    def add(kernel: str, dtype: torch.dtype, launch: dict, source: str) -> None:
        key = (kernel, _TRITON_DTYPE[dtype], tuple(sorted(launch.items())))
        out.setdefault(key, Spec(kernel, key[1], key[2], source))

    for dtype in dtypes:
        for name, hidden, heads, kv_heads, head in shapes:
            group = heads // kv_heads
            for splits in decode_splits:
                for flags in variants:
                    add("_decode_kernel", dtype, pa.decode_launch(head, group, splits, dtype, **flags), name)
                if splits > 1:
                    add("_decode_reduce_kernel", dtype, pa.decode_reduce_launch(head, splits), name)
            for flags in variants:
                add("_prefill_kernel", dtype, pa.prefill_launch(head, group, dtype, **flags), name)
            add("_store_kv_kernel", dtype, kv_store.store_kv_launch(kv_heads, head), name)
            for size in (hidden, head):  # layer norms and qwen3's per-head q/k norms
                for residual in (False, True):
                    add("_rms_norm_kernel", dtype, rms_norm.rms_norm_launch(size, residual), name)
            add("_rotary_kernel", dtype, rotary.rotary_launch(heads, kv_heads, head), name)
        for rank in ranks:
            for split in lora_splits:
                add("_sgmv_shrink_kernel", dtype, lo.sgmv_shrink_launch(rank, split, dtype), f"rank {rank}")
                add("_bgmv_shrink_kernel", dtype, lo.bgmv_shrink_launch(rank, split), f"rank {rank}")
            add("_sgmv_expand_kernel", dtype, lo.sgmv_expand_launch(rank, dtype), f"rank {rank}")
            add("_bgmv_expand_kernel", dtype, lo.bgmv_expand_launch(rank), f"rank {rank}")
        for name, hidden, inter in moe_shapes:
            for n, k in ((2 * inter, hidden), (hidden, inter)):
                add("_grouped_matmul_kernel", dtype, moe.grouped_matmul_launch(n, k, dtype), name)
    return list(out.values())


def _signature(fn, spec: Spec) -> tuple[dict, dict, dict, dict]:
    """ASTSource signature, constexprs, alignment attributes and compile options of one spec."""
    launch = dict(spec.launch)
    options = {k: launch.pop(k) for k in ("num_warps", "num_stages") if k in launch}
    ptr_types = KERNELS[spec.kernel][1]
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in launch:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = "*" + ptr_types.get(arg, spec.dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        else:
            signature[arg] = "fp32" if arg in FLOAT_ARGS else "i32"
    missing = set(launch) - set(fn.arg_names)
    if missing:
        raise ValueError(f"{spec.kernel}: launch table names {sorted(missing)}, not parameters of the kernel.")
    return signature, launch, attrs, options


def _resources(cubin: bytes) -> dict:
    """Registers and local memory (spills) of the cubin's kernel, from cuobjdump."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text.split("Function", 1)[1]))
    return {k.lower(): int(v) for k, v in usage.items()}


def compile_one(spec: Spec, arch: int) -> dict:
    """Compiles one specialization; returns its resources, or the error it failed with."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(KERNELS[spec.kernel][0]), spec.kernel)
    start = time.perf_counter()
    try:
        signature, constexprs, attrs, options = _signature(fn, spec)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        res = _resources(compiled.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"}
    res.update(smem=compiled.metadata.shared, warps=compiled.metadata.num_warps,
               seconds=time.perf_counter() - start)
    return res


def verdict(res: dict, arch: int, dtype: str = "bf16") -> str:
    if "error" in res:
        return "FAIL compile"
    if res["local"] or res["stack"]:
        return "spill (fp32: reported, not failed)" if dtype == "fp32" else "FAIL spill"
    if res["smem"] > SMEM_LIMIT[arch]:
        return "FAIL smem"
    if res["reg"] * 32 * res["warps"] > REGS_PER_BLOCK:
        return "FAIL regs"
    return "ok"


def kernel_tables(rows: list) -> tuple[list[str], int]:
    """One markdown table per kernel of (spec, arch, resources, origin) rows, and the failures."""
    lines, failures = [], 0
    for kernel in KERNELS:
        mine = [r for r in rows if r[0].kernel == kernel]
        if not mine:
            continue
        lines += ["", f"## `{kernel}`", "", "| arch | dtype | constexprs | warps | regs | spill B | smem KiB | from | status |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for spec, arch, res, _ in mine:
            status = verdict(res, arch, spec.dtype)
            failures += status.startswith("FAIL")
            if "error" in res:
                lines.append(f"| sm_{arch} | {spec.dtype} | {spec.label()} | | | | | {spec.source} | {status}: {res['error']} |")
                continue
            lines.append(f"| sm_{arch} | {spec.dtype} | {spec.label()} | {res['warps']} | {res['reg']} | "
                         f"{res['local'] + res['stack']} | {res['smem'] / 1024:.1f} | {spec.source} | {status} |")
    return lines, failures


def summary_table(rows: list) -> list[str]:
    """Per kernel: specializations, how many compiled in this run, the worst resources, failures."""
    lines = ["| kernel | specializations | compiled now | max registers (bf16/fp16) | spilling bf16/fp16 | "
             "spilling fp32 | max smem KiB | failures |", "|---|---|---|---|---|---|---|---|"]
    for kernel in KERNELS:
        mine = [r for r in rows if r[0].kernel == kernel]
        if not mine:
            continue
        built = [(s, a, r) for s, a, r, _ in mine if "error" not in r]
        half = [r for s, _, r in built if s.dtype != "fp32"]
        spills = lambda group: sum(1 for r in group if r["local"] or r["stack"])  # noqa: E731
        fails = sum(verdict(r, a, s.dtype).startswith("FAIL") for s, a, r, _ in mine)
        lines.append(f"| `{kernel}` | {len(mine)} | {sum(o == 'compiled' for *_, o in mine)} | "
                     f"{max((r['reg'] for r in half), default=0)} | {spills(half)} | "
                     f"{spills([r for s, _, r in built if s.dtype == 'fp32'])} | "
                     f"{max((r['smem'] for _, _, r in built), default=0) / 1024:.1f} | {fails} |")
    return lines


def _compile_all(jobs: list, workers: int) -> list:
    if not jobs:
        return []
    with ProcessPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(compile_one, *zip(*jobs)))


def kernel_sources() -> dict[str, str]:
    """Each kernel's source key (triton_aot_record.source_key), as the record stores them."""
    return {k: record_mod.source_key(getattr(importlib.import_module(m), k)) for k, (m, _) in KERNELS.items()}


def plan_ci(specs: list, quick: list, archs: list, record: dict, sources: dict) -> tuple[list, list, int]:
    """(specializations the record vouches for, with their entries; specializations to compile
    now; how many of those the record lacks): the quick sample is always compiled, to be
    compared with its entries."""
    quick_keys = {(s.kernel, s.dtype, s.launch) for s in quick}
    vouched, fresh, missing = [], [], 0
    for arch in archs:
        for spec in specs:
            entry = record_mod.recorded(record, sources, spec, arch)
            if entry is not None:
                vouched.append((spec, arch, entry))
            missing += entry is None
            if entry is None or (spec.kernel, spec.dtype, spec.launch) in quick_keys:
                fresh.append((spec, arch))
    return vouched, fresh, missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(SMEM_LIMIT))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every kernel and constexpr branch once per arch")
    mode.add_argument("--ci", action="store_true",
                      help="the full matrix from the committed record, compiling the quick sample and whatever "
                           "the record cannot vouch for")
    mode.add_argument("--update-record", action="store_true",
                      help="compile the full matrix for sm_80 and sm_90 and rewrite the record and docs/triton_aot.md")
    parser.add_argument("--max-fresh", type=int, default=96,
                        help="--ci: most specializations missing from the record it compiles before failing")
    parser.add_argument("--record", default=record_mod.RECORD_PATH, help=argparse.SUPPRESS)  # tests
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    import triton

    from vllm.attention.ops.rms_norm import _rms_norm_kernel

    if not isinstance(_rms_norm_kernel, triton.runtime.jit.JITFunction):
        parser.error("the kernels are interpreted functions here: unset TRITON_INTERPRET.")
    archs = sorted(SMEM_LIMIT) if args.update_record else args.arch
    specs = launched_specs(args.quick)
    vouched, jobs = [], [(spec, arch) for arch in archs for spec in specs]
    sources = kernel_sources()
    record = record_mod.load(args.record)
    if args.ci:
        vouched, jobs, missing = plan_ci(specs, launched_specs(True), archs, record, sources)
        stale = sorted(k for k in KERNELS if record["sources"].get(k) != sources[k])
        if missing > args.max_fresh:
            print(f"{missing} specializations are not vouched for by {os.path.relpath(args.record)} "
                  f"(kernels whose source changed since it was written: {', '.join(stale) or 'none'}); "
                  "regenerate it with `python benchmarks/triton_aot.py --update-record` (full matrix, about a "
                  "second of one core per compile when cold) and commit it with docs/triton_aot.md.")
            return 1
    start = time.perf_counter()
    results = _compile_all(jobs, args.jobs)
    header = (f"triton {triton.__version__}: {len(jobs)} compiles in {time.perf_counter() - start:.0f} s"
              + (f", {len(vouched)} specializations from the record" if args.ci else "")
              + " (smem limit per block: " + ", ".join(f"sm_{a} {SMEM_LIMIT[a] // 1024} KiB" for a in archs) + ")")
    fresh = {(s.kernel, s.dtype, s.launch, a): r for (s, a), r in zip(jobs, results)}
    rows, failures = [], 0
    for spec, arch, entry in vouched:
        now = fresh.pop((spec.kernel, spec.dtype, spec.launch, arch), None)
        why = record_mod.disagreement(entry, now) if now is not None else None
        if why:
            failures += 1
            print(f"FAIL record: sm_{arch} {spec.kernel} {spec.dtype} {spec.label()}: {why}")
        rows.append((spec, arch, now or entry, "compiled" if now else "record"))
    rows += [(s, a, fresh[(s.kernel, s.dtype, s.launch, a)], "compiled") for s, a in jobs
             if (s.kernel, s.dtype, s.launch, a) in fresh]
    tables, failed = kernel_tables(rows)
    failures += failed
    summary = summary_table(rows)
    print(header, "", *summary, sep="\n")
    if not args.ci:
        print(*tables, sep="\n")
    for kernel, where in NOT_CHECKED.items():
        print(f"\nNOT CHECKED: {kernel} in {where}: its launcher has no launch table yet")
    if args.update_record:
        record_mod.save(sources, [(s, a, r) for s, a, r, _ in rows], args.record)
        record_mod.write_table(header, summary, tables)
    print(f"\n{len(rows) - failures}/{len(rows)} pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
