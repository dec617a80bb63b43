"""benchmarks/cpu_attention.py on tiny shapes: both tables, the native kernel agreeing with the
path it is compared against, and the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm.attention.backends import cpu_native


@pytest.mark.skipif(not cpu_native.is_available(), reason="the native CPU attention kernel is not built here")
def test_decode_and_prompt_tables(tmp_path):
    out = tmp_path / "attention.json"
    cmd = [sys.executable, "-m", "benchmarks.cpu_attention", "--layers", "2", "--contexts", "40", "--batches", "1",
           "3", "--prompts", "24", "40+8", "--reps", "3", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Decode attention, 2 layers" in result.stdout and "Prompt attention, one layer" in result.stdout
    payload = json.loads(out.read_text())
    assert [(r["context"], r["batch"]) for r in payload["decode"]] == [(40, 1), (40, 3)]
    # 2 layers x keys and values x batch x 40 tokens x 3 KV heads x 64 features x 4 bytes
    assert [r["kv_bytes"] for r in payload["decode"]] == [2 * 2 * b * 40 * 3 * 64 * 4 for b in (1, 3)]
    assert all(r["ms"] > 0 and r["of_read"] > 0 for r in payload["decode"])
    assert [(r["context"], r["query_len"]) for r in payload["prompt"]] == [(0, 24), (40, 8)]
    for row in payload["prompt"]:
        assert row["native_ms"] > 0 and row["sdpa_ms"] > 0
        assert row["max_abs_diff"] < 1e-4  # the kernel and torch_ref compute the same attention


@pytest.mark.skipif(not cpu_native.is_available(), reason="the native CPU attention kernel is not built here")
def test_a_bf16_cache_under_fp32_counts_half_the_bytes(tmp_path):
    out = tmp_path / "attention.json"
    cmd = [sys.executable, "-m", "benchmarks.cpu_attention", "--kv-cache-dtype", "bfloat16", "--layers", "2",
           "--contexts", "40", "--batches", "1", "--prompts", "40+8", "--reps", "3", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "float32 (bfloat16 cache)" in result.stdout
    payload = json.loads(out.read_text())
    assert [r["kv_bytes"] for r in payload["decode"]] == [2 * 2 * 40 * 3 * 64 * 2]
    assert payload["prompt"][0]["max_abs_diff"] < 1e-4  # torch_ref reads the same bf16 cache


def test_heads_must_share_kv_heads_evenly():
    cmd = [sys.executable, "-m", "benchmarks.cpu_attention", "--heads", "8", "--kv-heads", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--heads (8) must be a multiple of --kv-heads (3)" in result.stderr
