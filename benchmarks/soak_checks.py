"""The soak harness's end checks (benchmarks/soak.py): reading the server's /metrics,
waiting for it to go idle, and turning the run's figures into pass/fail verdicts.

What it owns: `scrape` (every /metrics sample), `wait_idle`, `sample_series` (the
memory and load trend during the run), `evaluate` (the checks that
need the server's metrics: streams right, nothing failed, adapter churn clean, idle at
the end, no leaked KV-block references, resident memory held), and `log_check` (no
unhandled exception in the server log).

Invariants: a check is {"name", "passed": True | False | None (skipped: nothing to
check it against), "detail"}; the harness fails when any check has passed == False.
Leaked blocks are counted only once the server is idle (no running or waiting request):
in flight, held blocks are expected. `vllm:kv_cache_free_blocks` counts unreferenced
cached prefix blocks as free, so a warm prefix cache is no leak.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Anywhere in a line, and (the last) at a line's start: the level of vLLM's and uvicorn's log lines.
LOG_PATTERNS = ("Traceback", "Exception in ASGI application", "ERROR")

Samples = list[tuple[str, dict, float]]


async def scrape(http: httpx.AsyncClient) -> Samples:
    response = (await http.get("/metrics")).raise_for_status()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(response.text)
            for s in family.samples]


def value(samples: Samples, name: str, **labels) -> Optional[float]:
    """Sum of the samples called `name` whose labels include `labels`; None when absent."""
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
    return sum(found) if found else None


def _is_idle(samples: Samples) -> bool:
    return value(samples, "vllm:num_requests_running") == 0 and value(samples, "vllm:num_requests_waiting") == 0


async def wait_idle(http: httpx.AsyncClient, timeout: float) -> Samples:
    """Scrape until no request runs or waits and every block is free (or `timeout` passes:
    the caller judges the last scrape). Aborts of cut-off streams land a step or two after
    the client left, hence the wait."""
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(http)
        free, total = value(samples, "vllm:kv_cache_free_blocks"), value(samples, "vllm:kv_cache_total_blocks")
        if (_is_idle(samples) and free == total) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.5)


async def sample_series(http: httpx.AsyncClient, interval: float, out: list[dict]) -> None:
    """Every `interval` seconds until cancelled: the server's resident memory, requests and
    free blocks (the trend behind the end-of-run memory and leak checks)."""
    start = time.monotonic()
    while True:
        samples = await scrape(http)
        out.append({"t": round(time.monotonic() - start, 1),
                    "rss_mib": round((value(samples, "process_resident_memory_bytes") or 0) / 2**20, 1),
                    "running": value(samples, "vllm:num_requests_running"),
                    "waiting": value(samples, "vllm:num_requests_waiting"),
                    "free_blocks": value(samples, "vllm:kv_cache_free_blocks")})
        await asyncio.sleep(interval)


def _check(name: str, passed: Optional[bool], detail: str) -> dict:
    return {"name": name, "passed": passed, "detail": detail}


def evaluate(run: dict, before: Samples, warm_idle: Samples, end_idle: Samples, memory_tolerance: float) -> dict:
    """Figures read from the server and the metric-based checks, to merge into `run`."""
    phases = (run, run["warmup"])
    wrong, failed = sum(p["wrong"] for p in phases), sum(p["failed"] for p in phases)
    free, total = value(end_idle, "vllm:kv_cache_free_blocks"), value(end_idle, "vllm:kv_cache_total_blocks")
    leaked = None if free is None or total is None else int(total - free)
    rss_warm = value(warm_idle, "process_resident_memory_bytes")
    rss_end = value(end_idle, "process_resident_memory_bytes")

    def delta(name: str, **labels) -> Optional[int]:
        now, then = value(end_idle, name, **labels), value(before, name, **labels)
        return None if now is None else int(now - (then or 0))

    out = {
        "kv_blocks": f"{free:.0f}/{total:.0f}" if leaked is not None else "n/a", "leaked_blocks": leaked,
        "rss_warm_mib": round(rss_warm / 2**20, 1) if rss_warm else None,
        "rss_end_mib": round(rss_end / 2**20, 1) if rss_end else None,
        "rss_ratio": round(rss_end / rss_warm, 4) if rss_warm and rss_end else None,
        "alora_reused_prompt_tokens": delta("vllm:alora_reused_prompt_tokens_total"),
        "server_aborts": delta("vllm:request_success_total", finished_reason="abort"),
        "preemptions": delta("vllm:num_preemptions_total"),
    }
    checks = [
        _check("streams completed", run["completed"] > 0, f"{run['completed']} after warm-up"),
        _check("every finished stream as asked", wrong == 0,
               f"{wrong} with the wrong length, usage or JSON" if wrong else
               "exact lengths, usage = /tokenize and tokens received, structured output valid"),
        _check("no failed requests", failed == 0, f"{failed} failed (warm-up included)"),
    ]
    churn = run["adapter_loads"] + len(run["adapter_errors"])
    checks.append(_check("runtime adapter loads and unloads", None if churn == 0 else not run["adapter_errors"],
                         f"{run['adapter_loads']} loads, {run['adapter_unloads']} unloads, "
                         f"{len(run['adapter_errors'])} errors" if churn else "no churn in this run"))
    checks.append(_check("server idle after the run", _is_idle(end_idle),
                         f"running {value(end_idle, 'vllm:num_requests_running')}, "
                         f"waiting {value(end_idle, 'vllm:num_requests_waiting')}"))
    checks.append(_check("KV blocks all free when idle", leaked == 0,
                         f"free {out['kv_blocks']}" if leaked is not None else "the server reports no block gauges"))
    if rss_warm and rss_end:
        held = out["rss_ratio"] <= 1 + memory_tolerance
        checks.append(_check(f"memory within {memory_tolerance:.0%} of warm-up", held,
                             f"{out['rss_warm_mib']} MiB after warm-up, {out['rss_end_mib']} MiB at the end"))
    else:
        checks.append(_check("memory within tolerance", False,
                             "the server exposes no process_resident_memory_bytes in /metrics"))
    return {**out, "checks": checks}


def log_findings(path: str) -> list[str]:
    """Lines of the server log that show an unhandled exception or an error."""
    with open(path, errors="replace") as f:
        return [line.rstrip() for line in f
                if any(p in line for p in LOG_PATTERNS[:-1]) or line.startswith(LOG_PATTERNS[-1])]


def log_check(path: Optional[str]) -> tuple[dict, list[str]]:
    if not path:
        return _check("server log clean", None, "no server log given (--server-log)"), []
    findings = log_findings(path)
    detail = f"no {' / '.join(LOG_PATTERNS)} in {path}" if not findings else \
        f"{len(findings)} lines, first: {findings[0][:200]}"
    return _check("server log clean", not findings, detail), findings
