"""Soak: many concurrent streaming clients for a long time against the OpenAI server, with
disconnects and adapter churn, then checks that nothing leaked or went wrong.

    python -m benchmarks.soak                                  # launches `vllm serve` on SmolLM2-135M-Instruct
    python -m benchmarks.soak --model DIR --clients 32 --duration 20
    python -m benchmarks.soak --url http://host:8000 --server-log serve.log   # a running server

When it launches the server it writes a random LoRA and a random aLoRA for the model and
serves them (`--enable-lora --enable-activated-lora --lora-modules`, runtime loading on,
`--allowed-lora-root` = its adapter folder), keeping the server's log in the work folder.
With `--url` it discovers what the server serves from /v1/models (adapter configs must be
readable here, and `--adapter-root` must lie under the server's allowed LoRA root).

Traffic (benchmarks/soak_traffic.py): `--clients` clients share one connection pool and loop
over a mix of base, plain-LoRA, aLoRA-after-base, structured-output and n>1 requests with
prompts from 10 tokens to near max_model_len, every one streamed with usage; a share
(`--cancel-fraction`) is cut off on purpose, half before the first token, half mid-stream.
A background task keeps loading a fresh adapter under a new name, using it a few times and
unloading it. A warm-up phase (`--warmup` seconds of the same traffic) comes first.

Checks (exit status 1 when one fails): every request not cancelled finished with the length
it asked for (structured output: valid JSON within max_tokens) and usage matching /tokenize
and the tokens received; no request failed; adapter loads and unloads all succeeded; once
idle, `vllm:kv_cache_free_blocks` == `vllm:kv_cache_total_blocks` (unreferenced cached
blocks count as free: only leaked references fail it); the server's resident memory after
the run is within `--memory-tolerance` of its memory after warm-up; the server log holds no
Traceback, "Exception in ASGI application" or ERROR line.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import asyncio
import json
import random
import shlex
import shutil
import tempfile
import time
from typing import Optional

import httpx

from benchmarks.common import (
    ALL_TARGETS,
    add_model_args,
    engine_dtype,
    invocation_ids,
    launch_server,
    load_hf_config,
    load_line,
    machine_load,
    percentile,
    print_table,
    resolve_model,
    save_json,
    server_flags,
    server_root_url,
    stop_server,
    write_random_adapter,
)
from benchmarks.soak_checks import evaluate, log_check, sample_series, scrape, wait_idle
from benchmarks.soak_traffic import MIX, Outcome, Target, Traffic


# ----------------------------------------------------------------- the server and what it serves
def launch(args, workdir: str, adapter_root: str):
    """Write the adapters, start `vllm serve`; returns (process, url, log path)."""
    from transformers import AutoTokenizer

    model_dir, _ = resolve_model(args, workdir)
    hf_config = load_hf_config(model_dir)
    invocation = invocation_ids(AutoTokenizer.from_pretrained(model_dir), "certainty")
    dtype = engine_dtype(args, model_dir)
    lora = write_random_adapter(os.path.join(adapter_root, "soak-lora"), hf_config, args.rank, ALL_TARGETS, 1,
                                None, dtype)
    alora = write_random_adapter(os.path.join(adapter_root, "soak-alora"), hf_config, args.rank, ALL_TARGETS, 2,
                                 invocation, dtype)
    flags = ["--enable-lora", "--enable-activated-lora", "--max-loras", "3", "--max-lora-rank", str(args.rank),
             "--max-model-len", str(args.max_model_len), "--lora-modules", f"soak-lora={lora}",
             f"soak-alora={alora}", "--allowed-lora-root", adapter_root, *server_flags(args),
             *shlex.split(args.serve_args)]
    log = os.path.join(workdir, "server.log")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **({"OMP_NUM_THREADS": str(args.threads)}
                                                            if args.threads else {})}
    proc, url = launch_server(model_dir, flags, log, env=env)
    return proc, url, log


async def discover(http: httpx.AsyncClient) -> Target:
    """The base model and the adapters from /v1/models; an aLoRA's invocation text is its
    `alora_invocation_tokens` decoded by the server (legacy `invocation_string` as is)."""
    cards = (await http.get("/v1/models")).raise_for_status().json()["data"]
    base = next(c for c in cards if not c.get("parent"))
    target = Target(base["id"], base["max_model_len"], [], {}, base_root=base.get("root"))
    for card in cards:
        if not card.get("parent") or card["parent"] != base["id"]:
            continue
        config_path = os.path.join(card.get("root") or "", "adapter_config.json")
        if not os.path.isfile(config_path):
            print(f"note: adapter {card['id']!r} left out of the mix: {config_path} is not readable here")
            continue
        with open(config_path) as f:
            config = json.load(f)
        tokens, legacy = config.get("alora_invocation_tokens"), config.get("invocation_string")
        if tokens:
            response = await http.post("/detokenize", json={"model": base["id"], "tokens": tokens})
            target.aloras[card["id"]] = response.raise_for_status().json()["prompt"]
            target.invocation_ids = target.invocation_ids or list(tokens)
        elif legacy:
            target.aloras[card["id"]] = legacy
        else:
            target.loras.append(card["id"])
    return target


# ----------------------------------------------------------------- adapters loaded at runtime
class AdapterChurn:
    """Loads a fresh random adapter under a new name, sends `uses` requests to it, unloads
    it, deletes its folder; again and again until the deadline. Every other adapter is an
    aLoRA (with the served aLoRA's invocation) when the server serves one."""

    def __init__(self, http: httpx.AsyncClient, traffic: Traffic, root: str, hf_config, rank: int, dtype,
                 uses: int = 3, seed: int = 0):
        self.http, self.traffic, self.root = http, traffic, root
        self.hf_config, self.rank, self.dtype, self.uses = hf_config, rank, dtype, uses
        self.rng = random.Random(seed)
        self.loads = self.unloads = 0
        self.errors: list[str] = []
        self._count = 0

    async def run(self, deadline: float) -> None:
        target = self.traffic.target
        while time.monotonic() < deadline:
            self._count += 1
            name = f"soak-runtime-{self._count}"
            is_alora = target.invocation_ids is not None and self._count % 2 == 0
            path = os.path.join(self.root, name)
            await asyncio.to_thread(write_random_adapter, path, self.hf_config, self.rank, ALL_TARGETS,
                                    1000 + self._count, target.invocation_ids if is_alora else None, self.dtype)
            response = await self.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            if response.status_code != 200:
                self.errors.append(f"load {name}: HTTP {response.status_code}: {response.text[:200]}")
                shutil.rmtree(path, ignore_errors=True)
                await asyncio.sleep(1.0)
                continue
            self.loads += 1
            suffix = next(iter(target.aloras.values())) if is_alora else ""
            for _ in range(self.uses):
                await self.traffic.completion(self.rng, "runtime", name, suffix=suffix)
            response = await self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})
            if response.status_code == 200:
                self.unloads += 1
            else:
                self.errors.append(f"unload {name}: HTTP {response.status_code}: {response.text[:200]}")
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------- phases
async def phase(traffic: Traffic, churn: Optional[AdapterChurn], clients: int, seconds: float,
                drain_timeout: float) -> tuple[list[Outcome], float]:
    """`clients` client loops (and the churn) for `seconds`; then in-flight requests finish.
    Returns this phase's outcomes and its length (until the last request ended)."""
    first = len(traffic.outcomes)
    start = time.monotonic()
    deadline = start + seconds
    tasks = [asyncio.create_task(traffic.client_loop(i, deadline)) for i in range(clients)]
    if churn is not None:
        tasks.append(asyncio.create_task(churn.run(deadline)))
    done, pending = await asyncio.wait(tasks, timeout=seconds + drain_timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.monotonic() - start
    for task in done:
        if task.exception() is not None:
            traffic.outcomes.append(Outcome("client", "failed", f"client crashed: {task.exception()!r}"))
    if pending:
        traffic.outcomes.append(Outcome("client", "failed", f"{len(pending)} clients still busy "
                                                            f"{drain_timeout:.0f}s after the deadline"))
    return traffic.outcomes[first:], elapsed


def figures(outcomes: list[Outcome], elapsed: float) -> dict:
    by_status = {s: [o for o in outcomes if o.status == s] for s in ("ok", "wrong", "failed", "cancelled")}
    ttfts = [o.ttft for o in by_status["ok"] if o.ttft is not None]
    kinds = sorted({o.kind for o in outcomes})
    return {
        "seconds": round(elapsed, 1), "requests": len(outcomes), "completed": len(by_status["ok"]),
        "wrong": len(by_status["wrong"]), "failed": len(by_status["failed"]),
        "cancelled": len(by_status["cancelled"]),
        "cancelled_before_first_token": sum(o.cancel_phase == "prefill" for o in by_status["cancelled"]),
        "cancelled_mid_stream": sum(o.cancel_phase == "stream" for o in by_status["cancelled"]),
        "tokens_received": sum(o.tokens for o in outcomes),
        "tokens_per_s": round(sum(o.tokens for o in outcomes) / elapsed, 1) if elapsed else 0.0,
        "ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p99_s": round(percentile(ttfts, 99), 4),
        "by_kind": {k: {s: sum(o.kind == k for o in v) for s, v in by_status.items()} for k in kinds},
        "examples": [f"{o.kind} {o.status}: {o.detail}" for o in by_status["wrong"] + by_status["failed"]][:10],
    }


async def soak(args, url: str, adapter_root: str) -> dict:
    # Idle connections expire before uvicorn's 5 s keep-alive timeout closes them: reusing one
    # the server is closing at that moment would fail a request for the harness's own sake.
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8,
                          keepalive_expiry=2.0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(base_url=server_root_url(url), limits=limits, headers=headers,
                                 timeout=httpx.Timeout(None, connect=60.0)) as http:
        target = await discover(http)
        traffic = Traffic(http, target, tuple(args.output_len), args.cancel_fraction, args.seed, args.mix)
        await traffic.calibrate()
        churn = _make_churn(args, http, traffic, adapter_root)
        print(f"serving {target.base} (max_model_len {target.max_model_len}), LoRAs {target.loras}, "
              f"aLoRAs {sorted(target.aloras)}, runtime adapter churn {'on' if churn else 'off'}")
        before = await scrape(http)
        series: list[dict] = []
        sampler = asyncio.create_task(sample_series(http, args.sample_interval, series))
        warm, warm_seconds = await phase(traffic, churn, args.clients, args.warmup, args.drain_timeout)
        warm_idle = await wait_idle(http, args.idle_timeout)
        print(f"warm-up done: {len(warm)} requests in {warm_seconds:.0f}s")
        main_outcomes, seconds = await phase(traffic, churn, args.clients, args.duration, args.drain_timeout)
        end_idle = await wait_idle(http, args.idle_timeout)
        sampler.cancel()
    run = figures(main_outcomes, seconds)
    run["warmup"] = figures(warm, warm_seconds)
    run["adapter_loads"] = churn.loads if churn else 0
    run["adapter_unloads"] = churn.unloads if churn else 0
    run["adapter_errors"] = churn.errors[:10] if churn else []
    run["alora_skipped"] = traffic.alora_skipped
    run.update(evaluate(run, before, warm_idle, end_idle, args.memory_tolerance))
    run["series"] = series
    return run


def _make_churn(args, http, traffic: Traffic, adapter_root: str) -> Optional[AdapterChurn]:
    model_dir = args.model or traffic.target.base_root
    if args.no_adapter_churn or not model_dir or not os.path.isfile(os.path.join(model_dir, "config.json")):
        if not args.no_adapter_churn:
            print("note: adapter churn off: the model's config.json is not readable here (give --model)")
        return None
    return AdapterChurn(http, traffic, adapter_root, load_hf_config(model_dir), args.rank, engine_dtype(args, model_dir),
                        seed=args.seed)


def report(run: dict, args, load: dict) -> None:
    rows = [(name, run[key]) for name, key in (
        ("streams completed", "completed"), ("cancelled on purpose", "cancelled"),
        ("  before the first token", "cancelled_before_first_token"), ("  mid-stream", "cancelled_mid_stream"),
        ("failed", "failed"), ("finished wrong", "wrong"), ("tokens/s", "tokens_per_s"),
        ("TTFT p50 s", "ttft_p50_s"), ("TTFT p99 s", "ttft_p99_s"), ("adapter loads", "adapter_loads"),
        ("adapter unloads", "adapter_unloads"), ("KV blocks free/total", "kv_blocks"),
        ("leaked KV blocks", "leaked_blocks"), ("RSS after warm-up MiB", "rss_warm_mib"),
        ("RSS after run MiB", "rss_end_mib"), ("aLoRA reused prompt tokens", "alora_reused_prompt_tokens"),
        ("server aborts", "server_aborts"), ("preemptions", "preemptions"),
        ("aLoRA follow-ups skipped (no room)", "alora_skipped"))]
    print_table(f"Soak: {args.clients} clients, {run['seconds']}s (after {args.warmup:.0f}s warm-up), "
                f"{run['requests']} requests", rows, ("figure", "value"))
    print("\nper kind: " + ", ".join(f"{k} {v}" for k, v in run["by_kind"].items()))
    for example in run["examples"] + run["warmup"]["examples"] + run["adapter_errors"]:
        print(f"  ! {example}")
    print()
    for check in run["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[check["passed"]]
        print(f"{verdict}  {check['name']}: {check['detail']}")
    print(f"\n{load_line(load)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--url", default=None, help="a running server (default: launch one here)")
    parser.add_argument("--server-log", default=None, help="with --url: the server's log file to check")
    parser.add_argument("--api-key", default=None, help="with --url: the server's API key")
    parser.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic after warm-up")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of the same traffic first")
    parser.add_argument("--output-len", type=int, nargs=2, default=(1, 64), metavar=("MIN", "MAX"),
                        help="max_tokens range of the exact-length requests")
    parser.add_argument("--mix", nargs="+", default=None, metavar="KIND=WEIGHT",
                        help=f"request kinds and weights (default {' '.join(f'{k}={w}' for k, w in MIX.items())})")
    parser.add_argument("--cancel-fraction", type=float, default=0.1, help="share of requests cut off on purpose")
    parser.add_argument("--max-model-len", type=int, default=2048, help="of the launched server")
    parser.add_argument("--rank", type=int, default=8, help="rank of the random adapters")
    parser.add_argument("--serve-args", default="", help="more `vllm serve` flags for the launched server")
    parser.add_argument("--adapter-root", default=None,
                        help="folder for runtime adapters (under the server's --allowed-lora-root)")
    parser.add_argument("--no-adapter-churn", action="store_true", help="no runtime adapter loads")
    parser.add_argument("--workdir", default=None, help="adapters and the server log (default: a temp folder)")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="seconds in-flight requests may take after the deadline")
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to wait for an idle server")
    parser.add_argument("--memory-tolerance", type=float, default=0.10,
                        help="allowed growth of the server's resident memory from warm-up to the end")
    parser.add_argument("--sample-interval", type=float, default=5.0,
                        help="seconds between the memory and load samples kept in the JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    _validate(parser, args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="vllm-soak-")
    adapter_root = os.path.abspath(args.adapter_root or os.path.join(workdir, "adapters"))
    os.makedirs(adapter_root, exist_ok=True)
    server, log_path, url = None, args.server_log, args.url
    try:
        if url is None:
            server, url, log_path = launch(args, workdir, adapter_root)
        run = asyncio.run(soak(args, url, adapter_root))
    finally:
        if server is not None:
            stop_server(server)
    # Read after the server stopped: a launched server's whole log, shutdown included.
    check, run["log_findings"] = log_check(log_path)
    run["checks"].append(check)
    load = machine_load()
    report(run, args, load)
    save_json(args.json, {"args": vars(args), "url": url, "server_log": log_path, "load": load, **run})
    sys.exit(0 if all(c["passed"] is not False for c in run["checks"]) else 1)


def _validate(parser, args) -> None:
    problems = []
    if args.clients < 1:
        problems.append(f"--clients must be at least 1, got {args.clients}")
    if args.duration <= 0 or args.warmup < 0:
        problems.append(f"--duration must be > 0 and --warmup >= 0, got {args.duration} and {args.warmup}")
    if not 0 <= args.cancel_fraction <= 1:
        problems.append(f"--cancel-fraction must be in [0, 1], got {args.cancel_fraction}")
    if not 1 <= args.output_len[0] <= args.output_len[1]:
        problems.append(f"--output-len needs 1 <= MIN <= MAX, got {args.output_len}")
    if args.mix is not None:
        args.mix = _parse_mix(args.mix, problems)
    if args.server_log and not args.url:
        problems.append("--server-log is for --url (a launched server's log is kept in --workdir)")
    if problems:
        parser.error("; ".join(problems))


def _parse_mix(items: list[str], problems: list[str]) -> dict[str, float]:
    mix = {}
    for item in items:
        kind, _, weight = item.partition("=")
        try:
            mix[kind] = float(weight)
        except ValueError:
            weight = None
        if kind not in MIX or weight is None or mix[kind] < 0:
            problems.append(f"--mix takes KIND=WEIGHT with KIND one of {', '.join(MIX)} and WEIGHT >= 0, "
                            f"got {item!r}")
    if mix and not any(mix.values()):
        problems.append("--mix needs a positive weight")
    return mix


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
