"""Tensor parallelism on one machine: the same cores as one rank with all the threads against
N ranks with a share each (pinned to disjoint cores with VLLM_CPU_OMP_THREADS_BIND), on a
Granite-3.3-8B-shaped model cut to a few layers, random fp32 weights.

    python -m benchmarks.tensor_parallel                        # TP=1 (2 threads) vs TP=2 (1 each)
    python -m benchmarks.tensor_parallel --layers 8 --tp 1 2 --cores 0 1
    python -m benchmarks.tensor_parallel --model DIR --tokens 4  # any checkpoint (the smoke test)

Figures per setup: the batch-1 decode step (the time of N+1 generated tokens minus that of
one, over N) and a prefill (a prompt of --prompt-len tokens, one output token), with the
ratio to TP=1. Decode on the CPU is bound by reading weights, so N ranks on N cores can approach
Nx when each core has its own share of memory bandwidth; the all-reduces (two per layer) are the
cost. Not a test; docs/tensor_parallel.md records runs.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import tempfile
import time

from benchmarks.common import GRANITE_8B_SHAPE, dummy_dir, load_line, machine_load, print_table, save_json
from vllm import LLM, SamplingParams


def shaped_model(root: str, layers: int) -> str:
    """The Granite-8B-shaped dummy folder with `layers` layers."""
    path = dummy_dir(root, "granite-3.3-8b")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**GRANITE_8B_SHAPE, "num_hidden_layers": layers}, f)
    return path


def timed(llm: LLM, prompt: list[int], max_tokens: int, repeats: int) -> float:
    """Best of `repeats` wall times of one greedy request (the prefix cache is reset each time)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best


def measure(model: str, tp: int, cores: list[int], args) -> dict:
    kwargs = dict(tensor_parallel_size=tp, dtype="float32", max_model_len=args.prompt_len + args.tokens + 8,
                  enforce_eager=True)
    if args.load_format:
        kwargs["load_format"] = args.load_format
    if tp > 1 and len(cores) >= tp:
        per = len(cores) // tp
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(str(c) for c in cores[r * per:(r + 1) * per]) for r in range(tp))
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        kwargs["cpu_threads"] = max(1, len(cores) // tp)
    llm = LLM(model, **kwargs)
    try:
        short, prompt = [11, 12, 13, 14], [100 + i % 1000 for i in range(args.prompt_len)]
        timed(llm, short, 2, 1)  # warm-up
        one = timed(llm, short, 1, args.repeats)
        many = timed(llm, short, args.tokens + 1, args.repeats)
        prefill = timed(llm, prompt, 1, args.repeats)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"tp": tp, "decode_step_s": (many - one) / args.tokens, "prefill_s": prefill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder (default: the Granite-8B shape, dummy weights)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the Granite-8B-shaped model")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cores", type=int, nargs="+", default=sorted(os.sched_getaffinity(0)),
                        help="the cores every setup shares out (default: this process's)")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps timed")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    args.load_format = None if args.model else "dummy"
    with tempfile.TemporaryDirectory() as root:
        model = args.model or shaped_model(root, args.layers)
        load = machine_load()
        results = [measure(model, tp, args.cores, args) for tp in args.tp]
    base = results[0]
    rows = [(r["tp"], f"{len(args.cores) // r['tp']} x {r['tp']}", f"{r['decode_step_s'] * 1e3:.1f}",
             f"{base['decode_step_s'] / r['decode_step_s']:.2f}x", f"{r['prefill_s'] * 1e3:.0f}",
             f"{base['prefill_s'] / r['prefill_s']:.2f}x") for r in results]
    print_table(f"Tensor parallelism, {len(args.cores)} core(s) shared out ({args.model or f'Granite-8B shape, {args.layers} layers'}"
                f", fp32)", rows, ("tp", "threads x ranks", "decode ms", "speed-up", f"prefill {args.prompt_len} ms",
                                   "speed-up"))
    print(load_line(load))
    save_json(args.json, {"load": load, "results": results, "args": vars(args)})


if __name__ == "__main__":
    main()
