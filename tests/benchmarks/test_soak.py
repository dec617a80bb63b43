"""The soak harness (benchmarks/soak.py): its checks catch what they must on hand-made
streams, metrics and logs, and a short run against a launched server on the tiny llama
(32 clients, the whole mix, disconnects, runtime adapter churn) passes every check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.soak_checks import evaluate, log_check
from benchmarks.soak_traffic import Traffic, _absorb, _Stream
from vllm.entrypoints.openai.metrics import ServerMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _completion_stream(tokens: list[str], finish: str, prompt_tokens: int, completion_tokens: int) -> _Stream:
    state = _Stream()
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        _absorb({"choices": [{"index": 0, "text": token, "logprobs": {"tokens": [token]},
                              "finish_reason": finish if last else None}]}, state)
    _absorb({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}},
            state)
    return state


def test_verify_accepts_an_exact_stream_and_names_each_mismatch():
    assert Traffic._verify("base", _completion_stream(["a", " b", " c"], "length", 7, 3), 7, 3, 1) == ""
    short = Traffic._verify("base", _completion_stream(["a", " b"], "stop", 7, 2), 7, 3, 1)
    assert "finish 'stop' after 2 tokens, asked for 3" in short
    assert "usage.prompt_tokens 8 != /tokenize 7" in Traffic._verify(
        "base", _completion_stream(["a"], "length", 8, 1), 7, 1, 1)
    assert "usage.completion_tokens 2 != 1 received" in Traffic._verify(
        "base", _completion_stream(["a"], "length", 7, 2), 7, 1, 1)
    assert "choices [0] finished, expected 2" in Traffic._verify(
        "n", _completion_stream(["a"], "length", 7, 1), 7, 1, 2)


def test_verify_checks_structured_output_json_not_its_length():
    good = _Stream()
    _absorb({"choices": [{"index": 0, "delta": {"content": '{"label":"yes","ok":true}'},
                          "logprobs": {"content": [{"token": "t"}] * 9}, "finish_reason": "stop"}]}, good)
    _absorb({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}, good)
    assert Traffic._verify("structured", good, 5, 48, 1) == ""
    cut = _Stream()
    _absorb({"choices": [{"index": 0, "delta": {"content": '{"label":"y'},
                          "logprobs": {"content": [{"token": "t"}] * 4}, "finish_reason": "length"}]}, cut)
    _absorb({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}, cut)
    assert "structured output is not JSON" in Traffic._verify("structured", cut, 5, 4, 1)


def _samples(free: float, total: float, rss: float, running: float = 0.0) -> list:
    return [("vllm:kv_cache_free_blocks", {}, free), ("vllm:kv_cache_total_blocks", {}, total),
            ("process_resident_memory_bytes", {}, rss), ("vllm:num_requests_running", {}, running),
            ("vllm:num_requests_waiting", {}, 0.0)]


def _run(**overrides) -> dict:
    phase = {"completed": 10, "wrong": 0, "failed": 0}
    return {**phase, "warmup": dict(phase), "adapter_loads": 2, "adapter_unloads": 2, "adapter_errors": [],
            **overrides}


def test_evaluate_fails_on_leaked_blocks_memory_growth_and_failures():
    good = evaluate(_run(), [], _samples(100, 100, 1e9), _samples(100, 100, 1.05e9), 0.10)
    assert all(c["passed"] for c in good["checks"]) and good["leaked_blocks"] == 0
    bad = evaluate(_run(failed=1, adapter_errors=["load x: HTTP 400"]), [], _samples(100, 100, 1e9),
                   _samples(97, 100, 1.2e9, running=1), 0.10)
    failing = {c["name"] for c in bad["checks"] if c["passed"] is False}
    assert failing == {"no failed requests", "runtime adapter loads and unloads", "server idle after the run",
                       "KV blocks all free when idle", "memory within 10% of warm-up"}
    assert bad["leaked_blocks"] == 3 and bad["rss_ratio"] == 1.2


def test_log_check_finds_tracebacks_and_error_lines(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO 12-01 [x.py:1] fine\nINFO a prompt about an ERROR code\n")
    assert log_check(str(log))[0]["passed"] is True
    log.write_text("INFO ok\nERROR 12-01 [api_server.py:9] boom\nTraceback (most recent call last):\n")
    check, findings = log_check(str(log))
    assert check["passed"] is False and len(findings) == 2
    assert log_check(None)[0]["passed"] is None


def test_server_metrics_expose_the_process_memory():
    text = ServerMetrics("m").render().decode()
    if sys.platform.startswith("linux"):
        assert "process_resident_memory_bytes" in text


def test_soak_run_on_the_tiny_model(llama_dir, tmp_path):
    # Memory is judged by the long recorded run: seconds of warm-up do not reach the server's
    # steady resident memory (see docs/reliability.md), so here it only has to stay bounded.
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "benchmarks.soak", "--model", llama_dir, "--clients", "32", "--warmup", "3",
           "--duration", "8", "--max-model-len", "512", "--output-len", "1", "24", "--cancel-fraction", "0.15",
           "--threads", "1", "--sample-interval", "2", "--memory-tolerance", "1.0", "--workdir", str(tmp_path),
           "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["completed"] > 0 and run["failed"] == 0 and run["wrong"] == 0
    assert run["leaked_blocks"] == 0 and run["cancelled"] > 0 and run["adapter_loads"] > 0
    assert {"base", "lora", "alora", "structured", "n"} <= set(run["by_kind"])
    assert all(c["passed"] is not False for c in run["checks"]) and run["series"]
