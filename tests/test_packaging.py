"""What an install carries: a wheel built from this tree holds the C++ kernel sources, so
`pip install .` and wheels build the native CPU kernels on first use instead of silently
running the slow torch path."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_carries_the_kernel_sources(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), ROOT],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = [name for name in os.listdir(tmp_path) if name.endswith(".whl")]
    names = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    sources = sorted(n for n in os.listdir(os.path.join(ROOT, "vllm", "csrc", "cpu")) if n.endswith((".cpp", ".h")))
    assert sources == ["activation.cpp", "argmax.cpp", "attention_bf16_tiles.h", "attention_tasks.h",
                       "attention_tiles.h", "bf16_bits.h", "bf16_dot_linear.cpp", "decode_layer.cpp", "dense_gemv.cpp",
                       "fused_norm.cpp", "lora_runs.cpp", "native_vec.h", "paged_attention.cpp", "prefetch.h",
                       "quant_activations.h", "quant_int4_pairs.h", "quant_linear.cpp", "quant_rows.h", "quant_tiles.h",
                       "rotary_kv.cpp", "row_tiles.h"]
    assert {f"vllm/csrc/cpu/{n}" for n in sources} <= names
    assert "vllm/native_build.py" in names
