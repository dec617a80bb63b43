"""The intrinsic-pipeline benchmark (benchmarks/alora_pipeline.py): its accounting on
hand-made calls (seconds per conversation over rounds, batched floors that read the weights
once per step), and a whole offline run on the tiny test model whose JSON must show the
aLoRA reusing the base turn's blocks and the plain LoRA reusing none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.alora_pipeline import Call, Pipeline, Round, stage_floor, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeFloor:
    """1 s per 1000 prefill tokens; a decode step costs 1 s for the weights plus 0.001 s per
    context token of every sequence (the shape of benchmarks.common.Floor)."""

    def prefill_seconds(self, sequences):
        return sum(n for n, _ in sequences) / 1000

    def decode_seconds(self, contexts):
        return (1.0 + 0.001 * sum(contexts)) if contexts else 0.0

    def seconds(self, num_tokens, context=0):
        return self.prefill_seconds([(num_tokens, context)])


def call(mode, conv, rnd, step, prompt, cached, out, ttft):
    return Call(mode, conv, rnd, step, "x", prompt, cached, out, ttft, ttft + 1)


def test_stage_floor_reads_the_weights_once_per_step_for_the_batch():
    one = [call("alora", 0, 0, 0, 100, 0, 3, 0.1)]
    two = one + [call("alora", 1, 0, 0, 100, 0, 2, 0.1)]
    # prefill 0.1; decode steps at contexts 100 and 101: 1.1 + 1.101
    assert stage_floor(FakeFloor(), one) == pytest.approx(0.1 + 1.1 + 1.101)
    # prefill 0.2; step 1 decodes both (1 + 0.2), step 2 only the longer one (1.101)
    assert stage_floor(FakeFloor(), two) == pytest.approx(0.2 + 1.2 + 1.101)


def test_summary_divides_round_time_by_conversations():
    rounds = [Round("alora", 0, 2, 10.0), Round("lora", 0, 2, 30.0), Round("alora", 1, 2, 14.0),
              Round("lora", 1, 2, 34.0)]
    pipelines = [Pipeline(m, c, r.seconds, [r.seconds / 2, r.seconds]) for r in rounds for m, c in
                 [(r.mode, 2 * r.index), (r.mode, 2 * r.index + 1)]]
    calls = []
    for r in rounds:
        reuse = r.mode == "alora"
        for c in (2 * r.index, 2 * r.index + 1):
            calls += [call(r.mode, c, r.index, 0, 1000, 0, 4, 1.0),
                      call(r.mode, c, r.index, 1, 1010, 992 if reuse else 0, 2, 0.05 if reuse else 1.0)]
    summary = summarize(rounds, pipelines, calls, ["alora", "lora"], FakeFloor())
    assert summary["alora"]["seconds_per_conversation"] == pytest.approx(24.0 / 4)
    assert summary["lora"]["seconds_per_conversation"] == pytest.approx(64.0 / 4)
    assert summary["lora_over_alora_pipeline"] == pytest.approx(64.0 / 24.0)
    assert summary["lora_over_alora_ttft_p50"] == pytest.approx(20.0)
    assert summary["alora"]["pipeline_seconds_mean"] == pytest.approx(12.0)
    assert summary["alora"]["prompt_tokens_reused"] == 4 * 992
    assert summary["lora"]["prompt_tokens_reused"] == 0
    # Floor per round and mode: base stage 2.0 prefill + 3 shared decode steps, intrinsic stage
    # the uncached tokens + 1 shared decode step; the LoRA's is larger by its recompute.
    assert summary["lora"]["floor_seconds_per_conversation"] > summary["alora"]["floor_seconds_per_conversation"]
    assert summary["lora_over_alora_pipeline_at_floor"] > 1.0


def test_offline_run_on_the_tiny_model(llama_dir, tmp_path):
    out = tmp_path / "run.json"
    plot = tmp_path / "run.png"
    cmd = [sys.executable, "-m", "benchmarks.alora_pipeline", "--model", llama_dir, "--context-len", "96",
           "--answer-len", "6", "--intrinsic-len", "3", "--num-intrinsics", "2", "--num-conversations", "4",
           "--concurrency", "2", "--threads", "1", "--json", str(out), "--plot", str(plot)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "s/conv x aLoRA" in result.stdout and plot.stat().st_size > 0
    run = json.loads(out.read_text())
    assert len(run["rounds"]) == 2 * 3 and all(r["conversations"] == 2 for r in run["rounds"])
    calls = run["calls"]
    intrinsic = {m: [c for c in calls if c["mode"] == m and c["step"] >= 1] for m in ("alora", "lora", "base")}
    assert len(intrinsic["alora"]) == 4 * 2
    # The aLoRA reuses every full base block before its invocation; the plain LoRA none.
    assert all(c["cached_tokens"] >= 96 // 16 * 16 for c in intrinsic["alora"])
    assert all(c["cached_tokens"] == 0 for c in intrinsic["lora"])
    assert all(c["output_tokens"] == 3 for c in intrinsic["alora"] + intrinsic["lora"])
    summary = run["summary"]
    assert summary["alora"]["prompt_tokens_reused"] == summary["base"]["prompt_tokens_reused"] > 0
    assert summary["lora_over_alora_pipeline_at_floor"] > 1.0
