"""benchmarks/engine_steps.py --interleave on the tiny test Llama: every precision's engine timed in
turns, each round's ratio to the first precision and to its own minute's floor, and the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_interleaved_decode_times_each_precision_every_round(tmp_path):
    out = tmp_path / "steps.json"
    cmd = [sys.executable, "-m", "benchmarks.engine_steps", "--tiny", "--precision", "fp32", "int8", "--interleave",
           "3", "--decode-context", "32", "--threads", "1", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "x faster than fp32" in result.stdout
    interleaved = json.loads(out.read_text())["interleaved"]
    assert set(interleaved) == {"fp32", "int8"}
    assert "x floor, same minute" in result.stdout
    for figures in interleaved.values():
        assert len(figures["ms"]) == 3 and all(ms > 0 for ms in figures["ms"]) and figures["floor_ms"] > 0
        # Each timing against its own minute's floor, which reads no faster than the run's fastest.
        same = figures["x_floor_same_minute"]
        assert len(same) == 3 and all(0 < x <= ms / figures["floor_ms"] * (1 + 1e-9)
                                      for x, ms in zip(same, figures["ms"]))
    # One bandwidth for every floor: the fastest measured over the run's rounds.
    assert interleaved["fp32"]["floor_bandwidth_bytes_per_s"] == interleaved["int8"]["floor_bandwidth_bytes_per_s"] > 0
    assert interleaved["fp32"]["speedup_over_fp32"] == 1.0
    assert interleaved["int8"]["speedup_over_fp32"] > 0


def test_interleave_needs_two_precisions():
    cmd = [sys.executable, "-m", "benchmarks.engine_steps", "--tiny", "--precision", "fp32", "--interleave", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--interleave needs two or more --precision values" in result.stderr
