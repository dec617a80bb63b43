"""The committed record of the full ahead-of-time compile matrix (benchmarks/triton_aot.py), so
that CI checks every launched specialization without compiling all of them.

A cold compile costs about a second of one core per specialization and the full matrix has
well over a thousand, more than CI's 30 minutes on 2 cores can spare. `triton_aot.py
--update-record` compiles them all and writes benchmarks/triton_aot_record.json (and the
readable table docs/triton_aot.md); `triton_aot.py --ci` then compiles only what the record
cannot vouch for.

Invariants:
- An entry stands for one (target, kernel, dtype, launch table). It vouches for a compile
  only while the kernel's source key is the one recorded with it: the key hashes the
  triton version, the kernel's source and, transitively, the source of every @triton.jit
  function and the value of every global constant it names. Editing a kernel, a helper it
  calls, a constant it reads or the triton version makes all of that kernel's entries stale;
  comments and code elsewhere in the file do not.
- A launch table absent from the record (a new model shape, a new branch) is simply missing:
  CI compiles it, up to a budget; beyond the budget CI fails and names the command that
  regenerates the record, so a stale record cannot pass silently and CI time stays bounded.
- CI recompiles a sample (every kernel, both sides of every constexpr branch: `--quick`) and
  fails when a recorded entry disagrees with its fresh compile, so a record that no longer
  describes what this toolchain produces is caught.
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_PATH = os.path.join(ROOT, "benchmarks", "triton_aot_record.json")
TABLE_PATH = os.path.join(ROOT, "docs", "triton_aot.md")
RESOURCE_FIELDS = ("reg", "local", "stack", "smem", "warps")


def _python_function(fn):
    """The plain function behind a JITFunction or, under TRITON_INTERPRET=1, an InterpretedFunction."""
    return getattr(fn, "fn", fn)


def _is_triton_function(value) -> bool:
    return type(value).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(value, "fn")


def source_key(fn) -> str:
    """sha256 of the triton version and everything a kernel's code depends on (see invariants)."""
    import triton

    digest = hashlib.sha256(f"triton {triton.__version__}\n".encode())
    seen: set[int] = set()

    def visit(jit_fn) -> None:
        py = _python_function(jit_fn)
        if id(py) in seen:
            return
        seen.add(id(py))
        src = textwrap.dedent(inspect.getsource(py))
        digest.update(src.encode())
        for name in sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", src))):
            value = py.__globals__.get(name)
            if _is_triton_function(value):
                visit(value)
            elif isinstance(value, (bool, int, float, str)) or type(value).__name__ == "constexpr":
                digest.update(f"{name}={value!r}\n".encode())

    visit(fn)
    return digest.hexdigest()


def entry_key(kernel: str, dtype: str, launch: tuple, arch: int) -> str:
    """One specialization on one target, as the record names it: every constexpr, warps and stages."""
    return f"sm_{arch} {kernel} {dtype} " + " ".join(f"{k}={v}" for k, v in launch)


def load(path: str = RECORD_PATH) -> dict:
    """{"sources": {kernel: source key}, "entries": {entry key: resources or {"error": ...}}}."""
    if not os.path.exists(path):
        return {"sources": {}, "entries": {}}
    with open(path) as f:
        return json.load(f)


def save(sources: dict, rows: list, path: str = RECORD_PATH) -> None:
    """rows: (spec, arch, resources) of the full matrix; timing fields are not recorded."""
    entries = {}
    for spec, arch, res in rows:
        kept = {"error": res["error"]} if "error" in res else {k: res[k] for k in RESOURCE_FIELDS}
        entries[entry_key(spec.kernel, spec.dtype, spec.launch, arch)] = {**kept, "from": spec.source}
    with open(path, "w") as f:
        json.dump({"sources": dict(sorted(sources.items())), "entries": dict(sorted(entries.items()))},
                  f, indent=0, sort_keys=False)
        f.write("\n")


def recorded(record: dict, sources: dict, spec, arch: int):
    """The recorded resources of a specialization, or None if the record cannot vouch for it."""
    if record["sources"].get(spec.kernel) != sources[spec.kernel]:
        return None
    entry = record["entries"].get(entry_key(spec.kernel, spec.dtype, spec.launch, arch))
    if entry is None:
        return None
    return {k: v for k, v in entry.items() if k != "from"}


def disagreement(entry: dict, fresh: dict) -> str | None:
    """Why a fresh compile contradicts its recorded entry (None when they agree)."""
    if ("error" in entry) != ("error" in fresh):
        return f"recorded {entry.get('error', 'compiled')}, now {fresh.get('error', 'compiled')}"
    if "error" in entry:
        return None
    diffs = [f"{k} {entry[k]} -> {fresh[k]}" for k in RESOURCE_FIELDS if entry[k] != fresh[k]]
    return ", ".join(diffs) or None


def write_table(header: str, summary: list[str], tables: list[str], path: str = TABLE_PATH) -> None:
    """docs/triton_aot.md: what --update-record compiled, every row."""
    today = datetime.date.today().isoformat()
    text = ["# Triton kernels: the full ahead-of-time compile table", "",
            "Generated by `python benchmarks/triton_aot.py --update-record` (full matrix, no GPU needed), "
            f"{today}; the same rows are in `benchmarks/triton_aot_record.json`, which CI checks "
            "(`--ci`). See [benchmarks.md](benchmarks.md#triton-kernels-ahead-of-time-compile-sm_80-sm_90) "
            "for the method.", "", header, "", *summary, "", *tables]
    with open(path, "w") as f:
        f.write("\n".join(text).rstrip() + "\n")
