"""Online serving: a request-rate sweep against the OpenAI-compatible server, with
streaming clients (the openai package). For each rate, requests arrive as a Poisson
process (`inf`: all at once) and stream their tokens; reported are time to first token
and inter-token latency percentiles, time per output token, and throughput.

    python -m benchmarks.serving                               # starts `vllm serve` (CPU, default ~135M model)
    python -m benchmarks.serving --server http://host:8000     # a running server (same model for the tokenizer)
    python -m benchmarks.serving --granite-8b-dummy --rates 1 4 16 inf --num-prompts 200   # GPU
    python -m benchmarks.serving --adapter-fraction 0.5        # half the requests on adapters (LoRA + aLoRA)

Prompts are random token ids from a locally generated length distribution (fresh ones
for each rate, so no rate reuses another's cache) sent to /v1/completions with
`ignore_eos`, so every request produces exactly its output length. Inter-token latency
is the gap between streamed chunks. When the benchmark starts the server itself it also
measures this machine's floor: the time to first token of a lone request of the mean
prompt length, and one decode step (weight bytes over the measured bandwidth).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from benchmarks.common import (
    ALL_TARGETS,
    INTRINSIC_NAMES,
    Floor,
    add_model_args,
    default_device,
    engine_dtype,
    invocation_ids,
    launch_server,
    load_hf_config,
    load_line,
    machine_load,
    openai_base_url,
    percentile,
    print_table,
    resolve_model,
    save_json,
    server_flags,
    stop_server,
    write_adapter_pair,
)


@dataclass
class Result:
    prompt_tokens: int
    output_tokens: int
    ttft: float
    latency: float
    adapter: Optional[str]
    gaps: list[float] = field(default_factory=list)
    error: Optional[str] = None


def make_requests(tokenizer, vocab_size: int, n: int, input_range, output_range, adapters: list[str],
                  invocations: dict, fraction: float, seed: int) -> list[tuple[list[int], int, Optional[str]]]:
    """n (prompt ids, output length, adapter or None). Adapter requests alternate plain
    LoRA and aLoRA; every prompt ends with an invocation so all compute the same tokens."""
    rng = random.Random(seed)
    low = min(100, vocab_size - 1)
    any_invocation = next(iter(invocations.values()), [])
    out = []
    for i in range(n):
        adapter = adapters[rng.randrange(len(adapters))] if adapters and rng.random() < fraction else None
        invocation = invocations.get(adapter.split("-", 1)[1], any_invocation) if adapter else any_invocation
        length = rng.randint(*input_range)
        prompt = [rng.randrange(low, vocab_size) for _ in range(max(1, length - len(invocation)))] + invocation
        out.append((prompt, rng.randint(*output_range), adapter))
    return out


async def one_request(client, model: str, prompt: list[int], max_tokens: int, adapter: Optional[str]) -> Result:
    start = time.perf_counter()
    ttft, last, gaps, usage = None, None, [], None
    try:
        stream = await client.completions.create(
            model=adapter or model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return Result(len(prompt), 0, float("nan"), time.perf_counter() - start, adapter, error=repr(e))
    latency = time.perf_counter() - start
    return Result(len(prompt), usage.completion_tokens if usage else len(gaps) + 1,
                  ttft if ttft is not None else latency, latency, adapter, gaps)


async def run_rate(client, model: str, requests, rate: float, max_concurrency: Optional[int], seed: int,
                   desc: str) -> tuple[list[Result], float]:
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, dynamic_ncols=True)

    async def fire(delay, req):
        await asyncio.sleep(delay)
        if limit:
            async with limit:
                r = await one_request(client, model, *req)
        else:
            r = await one_request(client, model, *req)
        bar.update(1)
        return r

    delays, t = [], 0.0
    for _ in requests:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    start = time.perf_counter()
    results = await asyncio.gather(*[fire(d, req) for d, req in zip(delays, requests)])
    elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def metrics(results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.error is None]
    gaps = [g for r in ok for g in r.gaps]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ttft = [r.ttft for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "seconds": elapsed,
        "request_throughput": len(ok) / elapsed, "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed,
        "ttft_mean": statistics.mean(ttft) if ttft else float("nan"),
        **{f"ttft_p{q}": percentile(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}": percentile(gaps, q) for q in (50, 90, 99)},
        "tpot_mean": statistics.mean(tpot) if tpot else float("nan"),
        "e2e_p50": percentile([r.latency for r in ok], 50),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def sweep(args, url: str, tokenizer, hf_config, adapters, invocations) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=openai_base_url(url), api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                timeout=3600, max_retries=0)
    models = await client.models.list()
    base = next((m.id for m in models.data if m.id not in adapters), models.data[0].id)
    missing = [a for a in adapters if a not in {m.id for m in models.data}]
    if missing:
        raise SystemExit(f"The server does not serve {missing}; start it with --lora-modules (see --help).")
    # Warm-up: a few short requests, every adapter among them.
    warm = make_requests(tokenizer, hf_config.vocab_size, max(4, len(adapters)), (16, 32), (2, 4), adapters,
                         invocations, 1.0 if adapters else 0.0, seed=-1)
    await asyncio.gather(*[one_request(client, base, *req) for req in warm])
    out = {}
    for i, rate in enumerate(args.rates):
        requests = make_requests(tokenizer, hf_config.vocab_size, args.num_prompts, tuple(args.input_len),
                                 tuple(args.output_len), adapters, invocations, args.adapter_fraction, seed=1000 + i)
        results, elapsed = await run_rate(client, base, requests, rate, args.max_concurrency, seed=i,
                                          desc=f"rate {rate:g} req/s")
        out[str(rate)] = {"metrics": metrics(results, elapsed), "load": machine_load(),
                          "results": [asdict(r) for r in results] if args.save_requests else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--server", default=None, help="URL of a running server (default: start one here)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, float("inf")],
                        help="request rates (requests/s; inf sends all at once)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--adapter-fraction", type=float, default=0.0,
                        help="share of requests on adapters (plain LoRA and aLoRA alternating)")
    parser.add_argument("--num-adapters", type=int, default=2, help="distinct aLoRAs (and as many plain LoRAs)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=ALL_TARGETS)
    parser.add_argument("--save-requests", action="store_true", help="keep every request's timings in the JSON")
    args = parser.parse_args()
    device = default_device()
    root = tempfile.mkdtemp(prefix="vllm-bench-serving-")
    model_dir, _ = resolve_model(args, root)
    hf_config = load_hf_config(model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = engine_dtype(args, model_dir)
    names = [INTRINSIC_NAMES[i % len(INTRINSIC_NAMES)] for i in range(args.num_adapters)]
    invocations = {n: invocation_ids(tokenizer, n) for n in names}
    adapters = [f"{kind}-{n}" for n in names for kind in ("alora", "lora")] if args.adapter_fraction > 0 else []
    server, floor = None, None
    max_len = max(4096, args.input_len[1] + args.output_len[1] + 16)
    try:
        url = args.server
        if url is None:
            flags = ["--max-model-len", str(max_len)]
            if adapters:
                modules = []
                for i, n in enumerate(names):
                    a, lo = write_adapter_pair(root, hf_config, n, args.rank, args.targets, seed=i,
                                               invocation=invocations[n], dtype=dtype)
                    modules += [f"alora-{n}={a}", f"lora-{n}={lo}"]
                flags += ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
                          "--lora-modules", *modules]
            flags += server_flags(args)
            env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
            server, url = launch_server(model_dir, flags, os.path.join(root, "server.log"), env=env)
            floor = Floor(hf_config, dtype, device)
        load_before = machine_load()
        print(f"server {url}, {device}, {load_line(load_before)}")
        per_rate = asyncio.run(sweep(args, url, tokenizer, hf_config, adapters, invocations))
    finally:
        if server is not None:
            stop_server(server)
    load_after = machine_load()

    mean_in = sum(args.input_len) / 2
    rows = []
    for rate, entry in per_rate.items():
        m = entry["metrics"]
        row = [rate, f"{m['completed']}/{m['completed'] + m['failed']}", f"{m['request_throughput']:.2f}",
               f"{m['output_throughput']:.1f}", f"{m['ttft_p50'] * 1e3:.0f}", f"{m['ttft_p90'] * 1e3:.0f}",
               f"{m['ttft_p99'] * 1e3:.0f}", f"{m['itl_p50'] * 1e3:.1f}", f"{m['itl_p90'] * 1e3:.1f}",
               f"{m['itl_p99'] * 1e3:.1f}", f"{m['tpot_mean'] * 1e3:.1f}"]
        if floor is not None:
            row += [f"{m['ttft_p50'] / floor.seconds(int(mean_in)):.1f}",
                    f"{m['itl_p50'] / floor.seconds(1, int(mean_in)):.1f}"]
        rows.append(tuple(row))
    headers = ("rate req/s", "done", "req/s", "out tok/s", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99",
               "TPOT ms")
    if floor is not None:
        headers += ("TTFT p50 x floor", "ITL p50 x floor")
    mix = f", {args.adapter_fraction:.0%} on adapters (LoRA + aLoRA)" if adapters else ""
    print_table(f"Serving sweep: {args.num_prompts} requests per rate, input {args.input_len[0]}-{args.input_len[1]}, "
                f"output {args.output_len[0]}-{args.output_len[1]} tokens{mix}, {device}", rows, headers)
    print(f"\n{load_line(load_after)} (before: {load_line(load_before)})")
    if floor is not None:
        print(f"floor: lone {int(mean_in)}-token prefill {floor.seconds(int(mean_in)) * 1e3:.0f} ms, "
              f"decode step {floor.seconds(1, int(mean_in)) * 1e3:.1f} ms")
    save_json(args.json, {"device": device, "model": model_dir, "server": args.server, "args": vars(args),
                          "floor": floor.as_dict() if floor else None, "load_before": load_before,
                          "load_after": load_after, "rates": per_rate})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
