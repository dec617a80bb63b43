"""benchmarks/engine_steps.py on the tiny test Llama: --interleave (every precision's engine timed in
turns, each round's ratio to the first precision and to its own minute's floor), the prefill against
the floor of its own minute, and the JSON they write."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_steps(tmp_path, *args: str) -> tuple[str, dict]:
    """engine_steps on the tiny Llama, one thread, with `args`: (its stdout, the JSON it wrote)."""
    out = tmp_path / "steps.json"
    cmd = [sys.executable, "-m", "benchmarks.engine_steps", "--tiny", *args, "--threads", "1", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, json.loads(out.read_text())


def test_interleaved_decode_times_each_precision_every_round(tmp_path):
    stdout, payload = run_steps(tmp_path, "--precision", "fp32", "int8", "--interleave", "3", "--decode-context", "32")
    assert "x faster than fp32" in stdout
    interleaved = payload["interleaved"]
    assert set(interleaved) == {"fp32", "int8"}
    assert "x floor, same minute" in stdout
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
    stdout, payload = run_steps(tmp_path, "--figures", "prefill", "--prefill-lengths", "64", "--prefill-rounds", "2")
    assert "against the floor of its own minute (2 rounds, median)" in stdout
    figures = payload["default"]
    prefill = figures["prefill 64 tokens"]
    assert prefill["ms"] > 0 and prefill["floor_ms"] > 0
    assert prefill["x_floor_same_minute"] > 0
    own = figures["  against the floor of its own minute (2 rounds, median)"]
    assert own["ms"] == prefill["ms"] and own["ms"] / own["floor_ms"] == pytest.approx(prefill["x_floor_same_minute"])


def test_decode_step_is_split_on_its_own_path_and_on_the_per_op_path(tmp_path):
    _, payload = run_steps(tmp_path, "--figures", "decode", "--batches", "1", "--decode-context", "32")
    figures = payload["default"]
    names = list(figures)
    native = names.index("  the same step with clocks around its native layers and LM head (the parts add up to it)")
    per_op = names.index("  the same step on the per-op path, timed part by part (the parts add up to it)")
    assert native < per_op
    for title, count in ((native, 3), (per_op, 4)):
        parts = [figures[name]["ms"] for name in names[title + 1:title + 1 + count]]
        assert sum(parts) == pytest.approx(figures[names[title]]["ms"], rel=1e-6)
    layers, lm_head, rest = names[native + 1:native + 4]
    assert layers.startswith("  native decoder layers") and lm_head.startswith("  LM head")
    assert rest.startswith("  the rest") and figures[layers]["ms"] > 0 and figures[lm_head]["ms"] > 0
