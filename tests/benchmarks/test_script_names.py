"""Every benchmark runs as `python benchmarks/NAME.py` as well as `python -m benchmarks.NAME`.

Run by path, Python puts benchmarks/ first on sys.path, so a file there named like an installed
package hides that package from every library the script imports: transformers 5 imports the
`kernels` package whenever it is installed, which a benchmarks/kernels.py broke for every script
run by path (engine_steps.py among them). No model needed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_no_benchmark_file_hides_an_installed_module():
    hidden = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.stem == "__init__":
            continue
        spec = importlib.util.find_spec(path.stem)
        if spec is not None and spec.origin is not None and Path(spec.origin).resolve() != path:
            hidden.append(f"{path.name} hides {spec.origin}")
    assert not hidden, hidden


def test_transformers_imports_with_benchmarks_first_on_the_path():
    """The import chain that broke, in a fresh interpreter: benchmarks/ first on sys.path (as a
    script run by path has it), then transformers' hub integrations and a model config."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import transformers.integrations.hub_kernels; "
            "from transformers import LlamaConfig; print('ok')")
    result = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
