"""Scale out on one machine: the aLoRA intrinsic pipeline (benchmarks/alora_pipeline.py,
online, C clients) against N replicas with cores/N threads each behind vllm-router, against one
replica with all the cores, in one run (docs/scale_out.md).

Setups, each started with examples/scale_out/run_replicas.sh (the launcher users run) and
measured on fresh conversations of the same length:

  cache_aware  N replicas, `--cpu-threads cores/N` each, each pinned to its own cores
               (taskset), router `--policy cache_aware --cache-threshold 0.05`;
  round_robin  the same replicas (restarted, so no cache carries over), router round robin:
               an intrinsic finds its conversation's blocks only when it lands home by chance;
  single       one replica, `--cpu-threads cores`, pinned to all of them, behind the router too
               (so every setup pays the same hop).

    python -m benchmarks.scale_out                       # packaged SmolLM2, 2 replicas x 1 core vs 1 x 2
    python -m benchmarks.scale_out --setups cache_aware single --json r.json --plot p.png
    python -m benchmarks.scale_out --router http://127.0.0.1:8000 --model MODEL_DIR --load-adapters

`--router URL` measures a running router and the replicas it lists (GET /workers) instead;
`--load-adapters` loads the adapters on each of them first (examples/scale_out/load_adapter.py)
and unloads them at the end.

Prompts go out as text: the router's cache_aware policy matches the text of requests, and
token-id prompts give it none. Every replica is warmed up directly (each adapter once) before
the measured conversations. Reported per setup: intrinsic TTFT p50/p90, the base turn's TTFT,
seconds per conversation (the rounds' wall time over their conversations), the share of
intrinsic calls that found cached tokens and of intrinsic prompt tokens that were cached, and
the requests each replica served.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import asyncio
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict
from typing import Optional

import httpx
import torch

from examples.scale_out.load_adapter import load_on_every_replica, router_replicas

from benchmarks.alora_pipeline import OnlineRunner, Setup, serve_command, summarize
from benchmarks.common import (
    ALL_TARGETS,
    add_model_args,
    engine_dtype,
    load_hf_config,
    load_line,
    machine_load,
    print_table,
    resolve_model,
    save_json,
    turn_ids,
)
from vllm.executor.multiproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "examples", "scale_out", "run_replicas.sh")
SETUPS = ("cache_aware", "round_robin", "single")
MODES = ["alora"]  # the intrinsics are aLoRAs: what cache affinity is for


class TextSetup(Setup):
    """Conversations that survive decode -> encode: the text a client sends (and the router
    matches) is then exactly the prompt measured, and never longer than --context-len."""

    def conversation(self, mode: str, index: int) -> list[int]:
        ids = super().conversation(mode, index)
        user, closing, _ = turn_ids(self.tokenizer)
        body = ids[len(user):len(ids) - len(closing)]
        # Random ids may split a character (one decoded "\ufffd" re-encodes as several tokens):
        # drop trailing ids until the re-encoded body fits.
        for keep in range(len(body), 0, -1):
            text = self.tokenizer.encode(self.tokenizer.decode(body[:keep]), add_special_tokens=False)
            if len(text) <= len(body):
                return user + text + closing
        raise ValueError(f"no prefix of conversation {index} survives decode -> encode within {len(body)} tokens")


class Deployment:
    """One run of examples/scale_out/run_replicas.sh: `replicas` replicas with `threads` CPU
    threads each (pinned to `pins`, one taskset core list per replica, when given) behind the
    router on a free port. Ready once the router's /readiness answers; `close()` stops the
    launcher's whole process group (the launcher, its replicas and the router)."""

    def __init__(self, model_dir: str, replicas: int, threads: int, policy: str, pins: Optional[list[str]],
                 serve_flags: list[str], log_dir: str, timeout: float):
        # The launcher gives the replicas and the router's metrics the ports after the router's:
        # a taken one fails that replica's start, reported with its log.
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(log_dir, exist_ok=True)
        env = {**os.environ, "PORT": str(self.port), "POLICY": policy, "THREADS_PER_REPLICA": str(threads),
               "LOG_DIR": log_dir, "TOKENIZERS_PARALLELISM": "false",
               # `vllm serve` runs this checkout's engine, installed or not.
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("PIN_CORES", None)
        if pins:
            env["PIN_CORES"] = " ".join(pins)
        self.log = open(os.path.join(log_dir, "launcher.log"), "w")
        # A session of its own: close() signals the launcher and everything it started at once.
        self.proc = subprocess.Popen(["bash", LAUNCHER, model_dir, str(replicas), "--", *serve_flags], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout)
            self.replicas = router_replicas(self.url)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"run_replicas.sh exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/readiness", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"router and replicas not ready after {timeout:.0f}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def core_lists(cores: int, replicas: int) -> Optional[list[str]]:
    """`replicas` disjoint taskset core lists of cores/replicas cores each, from the cores this
    process may use; None when pinning is unavailable (no taskset, or too few cores)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if shutil.which("taskset") is None or len(allowed) < cores:
        return None
    each = cores // replicas
    return [",".join(str(c) for c in allowed[i * each:(i + 1) * each]) for i in range(replicas)]


def measure(name: str, args, setup: Setup, model_dir: str, serve_flags: list[str], root: str) -> dict:
    """Start the setup with the launcher, measure it, stop it."""
    replicas = 1 if name == "single" else args.replicas
    threads = args.cores // replicas
    pins = core_lists(args.cores, replicas) if args.pin else None
    policy = "round_robin" if name == "round_robin" else "cache_aware"
    started = time.perf_counter()
    with Deployment(model_dir, replicas, threads, policy, pins, serve_flags, os.path.join(root, name),
                    args.start_timeout) as deployment:
        startup = time.perf_counter() - started
        result = measure_running(setup, deployment.url, deployment.replicas)
    print(f"{name}: {replicas} x {threads} threads, pinned {pins or 'no'}, started in {startup:.0f}s; "
          f"requests per replica {result['served_per_replica']}; {load_line(result['load_after'])}")
    return {"replicas": replicas, "threads_per_replica": threads, "pins": pins, "policy": policy,
            "startup_seconds": startup, **result}


def measure_running(setup: Setup, router_url: str, replicas: list[str]) -> dict:
    """Warm every replica directly, then run the pipeline through the router: the summary,
    the requests each replica served and every call."""
    for replica in replicas:  # each replica's first calls pay one-off costs: not measured
        asyncio.run(warm_up(setup, replica))
    served_before = served(replicas)
    load_before = machine_load()
    rounds, pipelines, calls = OnlineRunner(setup, router_url, text_prompts=True).run(MODES, _NoBar())
    load_after = machine_load()
    summary = summarize(rounds, pipelines, calls, MODES, None)["alora"]
    intrinsic = [c for c in calls if c.step >= 1]
    summary["intrinsic_calls_cached"] = sum(c.cached_tokens > 0 for c in intrinsic) / len(intrinsic)
    return {"served_per_replica": [a - b for a, b in zip(served(replicas), served_before)],
            "load_before": load_before, "load_after": load_after, "summary": summary,
            "calls": [asdict(c) for c in calls]}


def served(replicas: list[str]) -> list[int]:
    """Requests each replica finished (`vllm:request_success_total`, all reasons)."""
    counts = []
    for replica in replicas:
        lines = httpx.get(replica + "/metrics", timeout=10).text.splitlines()
        counts.append(int(sum(float(line.rsplit(" ", 1)[1]) for line in lines
                              if line.startswith("vllm:request_success_total"))))
    return counts


async def warm_up(setup: Setup, replica_url: str) -> None:
    runner = OnlineRunner(setup, replica_url, text_prompts=True)
    try:
        await runner.warm_up(MODES)
    finally:
        await runner.client.close()  # within this loop, which closes next


class _NoBar:
    """run_rounds' progress bar, silent (each setup prints one line when it is done)."""

    def update(self, n: int) -> None:
        pass


def print_results(results: dict, title: str) -> None:
    rows = []
    for name, r in results.items():
        s = r["summary"]
        rows.append((name, f"{r['replicas']} x {r['threads_per_replica'] or '?'}",
                     f"{s['intrinsic_ttft_p50'] * 1e3:.0f}", f"{s['intrinsic_ttft_p90'] * 1e3:.0f}", f"{s['base_turn_ttft_p50'] * 1e3:.0f}",
                     f"{s['seconds_per_conversation']:.2f}", f"{100 * s['intrinsic_calls_cached']:.0f}%",
                     f"{100 * s['intrinsic_hit_rate']:.0f}%", "+".join(str(n) for n in r["served_per_replica"])))
    print_table(title, rows, ("setup", "replicas x threads", "intrinsic TTFT p50 ms", "p90 ms", "base TTFT p50 ms",
                              "s/conv", "intrinsics cached", "intrinsic tokens cached", "requests per replica"))


def plot(path: str, results: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.38
    for j, (key, label, color) in enumerate((("intrinsic_ttft_p50", "intrinsic TTFT p50", "tab:blue"),
                                             ("intrinsic_ttft_p90", "intrinsic TTFT p90", "tab:orange"))):
        values = [results[n]["summary"][key] * 1e3 for n in names]
        bars = ax.bar([i + (j - 0.5) * width for i in range(len(names))], values, width, label=label, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n}\n{results[n]['replicas']} x {results[n]['threads_per_replica'] or '?'} threads\n"
                        f"{100 * results[n]['summary']['intrinsic_hit_rate']:.0f}% intrinsic tokens cached"
                        for n in names], fontsize=8)
    ax.set_ylabel("time to first token (ms)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    import textwrap

    ax.set_title("\n".join(textwrap.fill(line, 95) for line in title.split("\n")), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the scaled-out setups")
    parser.add_argument("--cores", type=int, default=2, help="CPU cores in every setup, split among its replicas")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin replicas to cores")
    parser.add_argument("--router", default=None, metavar="URL",
                        help="measure this running router and its replicas instead of starting setups")
    parser.add_argument("--load-adapters", action="store_true",
                        help="with --router: write the adapters and load them on every replica it lists (same "
                             "host; replicas with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), unloaded at the end")
    parser.add_argument("--adapter-dir", default=None, help="where to write the adapters (default: a temp folder)")
    parser.add_argument("--num-conversations", type=int, default=8, help="conversations per setup")
    parser.add_argument("--concurrency", type=int, default=4, help="clients in flight (conversations per round)")
    parser.add_argument("--context-len", type=int, default=512, help="conversation tokens")
    parser.add_argument("--answer-len", type=int, default=32, help="tokens of the base model's answer")
    parser.add_argument("--num-intrinsics", type=int, default=3, help="K intrinsics per conversation")
    parser.add_argument("--intrinsic-len", type=int, default=8, help="output tokens of each intrinsic")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="KV cache of each replica (the CPU default, 4 GiB, is far more than a run needs)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a setup to start")
    parser.add_argument("--plot", default=None, help="write the plot (PNG) here")
    args = parser.parse_args(argv)
    if args.kv_cache_gib <= 0:
        parser.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    for name in ("replicas", "cores", "num_conversations", "concurrency", "context_len", "answer_len",
                 "num_intrinsics", "intrinsic_len", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.cores % args.replicas:
        parser.error(f"--cores ({args.cores}) must split evenly over --replicas ({args.replicas})")
    if args.threads or args.dummy:
        parser.error("--threads and --granite-*-dummy do not apply: --cores sets each replica's threads")
    if args.load_adapters and not args.router:
        parser.error("--load-adapters needs --router (started setups preload their adapters)")
    if not args.router and shutil.which("vllm-router") is None:
        parser.error("vllm-router is not installed (pip install vllm-router==0.1.17, in the dev extra)")
    # What alora_pipeline's online mode reads and this benchmark fixes.
    args.modes, args.targets, args.parallel_intrinsics = MODES, ALL_TARGETS, False
    args.context_cached, args.new_turn_len, args.long_prefill_token_threshold = False, 0, 0
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    """Run, print the table (and plot, JSON); returns setup name -> result."""
    args = parse_args(argv)
    # For logs and adapters: a running router needs it only to write the adapters there.
    needs_root = not args.router or (args.load_adapters and not args.adapter_dir)
    root = tempfile.mkdtemp(prefix="vllm-bench-scale-out-") if needs_root else None
    model_dir, _ = resolve_model(args)
    from transformers import AutoTokenizer

    setup = TextSetup(args, AutoTokenizer.from_pretrained(model_dir), load_hf_config(model_dir))
    print(f"model {model_dir}; files in {root or args.adapter_dir}; {load_line(machine_load())}")
    adapter_dir = args.adapter_dir or (os.path.join(root, "adapters") if root else None)
    if args.router:
        results = {"router": measure_router(args, setup, adapter_dir, engine_dtype(args, model_dir))}
    else:
        serve_flags = serve_command(setup.write_adapters(adapter_dir, engine_dtype(args, model_dir)), args) + \
            ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        results = {name: measure(name, args, setup, model_dir, serve_flags, root) for name in args.setups}

    load = list(results.values())[-1]["load_after"]
    title = (f"aLoRA pipeline through vllm-router, {args.cores} cores: {args.num_conversations} conversations x "
             f"{args.context_len} tokens, {args.concurrency} clients, {args.answer_len}-token answer, "
             f"{args.num_intrinsics} intrinsics x {args.intrinsic_len} tokens\n{load_line(load)}")
    if args.router:
        title = title.replace(f", {args.cores} cores", f" at {args.router}")
    print_results(results, title)
    if args.plot:
        plot(args.plot, results, title)
    save_json(args.json, {"model": model_dir, "args": vars(args), "setups": results})
    return results


def measure_router(args, setup: Setup, adapter_dir: Optional[str], dtype: torch.dtype) -> dict:
    """--router: the running deployment as it is (its replicas from the router's GET /workers)."""
    replicas = router_replicas(args.router)
    names = []
    if args.load_adapters:
        for name, path in sorted(setup.write_adapters(adapter_dir, dtype).items()):
            failures = {url: why for url, why in load_on_every_replica(replicas, name, path).items() if why}
            names.append(name)
            if failures:
                _unload(replicas, names)
                raise RuntimeError(f"loading adapter {name} failed on {failures}")
    try:
        result = measure_running(setup, args.router, replicas)
    finally:
        _unload(replicas, names)
    print(f"router {args.router}: requests per replica {result['served_per_replica']}; "
          f"{load_line(result['load_after'])}")
    return {"replicas": len(replicas), "threads_per_replica": None, "pins": None, "policy": None, **result}


def _unload(replicas: list[str], names: list[str]) -> None:
    for name in names:
        load_on_every_replica(replicas, name, unload=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the running setup is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
