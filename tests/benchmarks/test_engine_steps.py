"""benchmarks/engine_steps.py on the tiny test Llama: --interleave (every precision's engine timed in
turns, each round's ratio to the first precision and to its own minute's floor), the prefill against
the floor of its own minute, and the JSON they write."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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


def test_prefill_is_put_against_the_floor_of_its_own_minute(tmp_path):
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, "-m", "benchmarks.engine_steps", "--tiny", "--figures", "prefill", "--prefill-lengths", "64",
           "--prefill-rounds", "2", "--threads", "1", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "against the floor of its own minute (2 rounds, median)" in result.stdout
    figures = json.loads(out.read_text())["default"]
    prefill = figures["prefill 64 tokens"]
    assert prefill["ms"] > 0 and prefill["floor_ms"] > 0
    assert prefill["x_floor_same_minute"] > 0
    own = figures["  against the floor of its own minute (2 rounds, median)"]
    assert own["ms"] == prefill["ms"] and own["ms"] / own["floor_ms"] == pytest.approx(prefill["x_floor_same_minute"])
