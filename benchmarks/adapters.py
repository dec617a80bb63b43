"""Adapters on the engine: (a) aLoRA against plain LoRA time to first token on one long
conversation after a base turn, and (b) throughput of a batch where half the requests
use adapters (plain LoRA and aLoRA mixed) against the same batch on the base model.

    python -m benchmarks.adapters                        # CPU, default ~135M model, 2k-token conversations
    python -m benchmarks.adapters --granite-8b-dummy     # GPU, Granite-3.3-8B shapes, random bf16 weights
    python -m benchmarks.adapters --only ttft --conversation-len 512 --trials 1   # quick look

(a) For each trial a fresh conversation: the base model answers it (a base turn), then
the aLoRA is invoked on conversation + answer + invocation, then the plain LoRA with
the same weights on the same prompt. The aLoRA reuses the base turn's KV cache up to
the last full block before its invocation, so its first token should cost the few new
tokens; the plain LoRA recomputes the whole conversation. Each TTFT is also given as a
ratio to this machine's floor for the tokens it had to compute (FLOPs over the measured
matmul rate, or weight bytes over the measured bandwidth, whichever is larger).

(b) The same `--num-prompts` prompts twice, prefix cache reset before each run: all on
the base model, then a quarter plain LoRA and a quarter aLoRA (over `--num-adapters`
distinct adapters), the rest base. Every prompt ends with an invocation sequence, so
both runs compute the same tokens; aLoRA applies to the invocation and the output.
Runs alternate `--repeats` times; the best of each is compared.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import random
import statistics
import tempfile
import time


from benchmarks.common import (
    ALL_TARGETS,
    INTRINSIC_NAMES,
    Floor,
    add_model_args,
    conversation_ids,
    default_device,
    forward_flops,
    invocation_ids,
    load_line,
    machine_load,
    print_table,
    resolve_model,
    save_json,
    sync,
    turn_ids,
    write_adapter_pair,
)
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def timed(llm: LLM, prompts: list[list[int]], params, loras=None, bar: bool = False):
    sync_device = default_device()
    sync(sync_device)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=bar, lora_request=loras)
    sync(sync_device)
    return outputs, time.perf_counter() - start


# ------------------------------------------------------------------ (a) time to first token
def ttft_benchmark(llm: LLM, args, alora: LoRARequest, lora: LoRARequest, invocation: list[int],
                   floor: Floor) -> dict:
    tokenizer = llm.get_tokenizer()
    config = llm.llm_engine.model_config.hf_config
    _, _, end_turn = turn_ids(tokenizer)
    trials = []
    for trial in range(-1, args.trials):  # trial -1: a short untimed warm-up of the same path
        length = args.conversation_len if trial >= 0 else min(args.conversation_len, 128)
        conversation = conversation_ids(tokenizer, config.vocab_size, length, seed=1000 + trial)
        base_out, _ = timed(llm, [conversation], greedy(args.answer_len))
        answer = list(base_out[0].outputs[0].token_ids)
        prompt = conversation + answer + end_turn + invocation
        stats0 = llm.llm_engine.get_stats()
        alora_out, _ = timed(llm, [prompt], greedy(1), alora)
        stats1 = llm.llm_engine.get_stats()
        lora_out, _ = timed(llm, [prompt], greedy(1), lora)
        row = {
            "prompt_tokens": len(prompt),
            "base_turn_ttft": base_out[0].metrics.time_to_first_token,
            "alora_ttft": alora_out[0].metrics.time_to_first_token,
            "lora_ttft": lora_out[0].metrics.time_to_first_token,
            "alora_cached_tokens": alora_out[0].num_cached_tokens,
            "lora_cached_tokens": lora_out[0].num_cached_tokens,
            "alora_reused_tokens": stats1.alora_reused_tokens - stats0.alora_reused_tokens,
        }
        if trial < 0:
            continue
        trials.append(row)
        print(f"trial {trial}: aLoRA {row['alora_ttft'] * 1e3:.1f} ms ({row['alora_cached_tokens']} cached), "
              f"LoRA {row['lora_ttft'] * 1e3:.1f} ms ({row['lora_cached_tokens']} cached), "
              f"ratio {row['lora_ttft'] / row['alora_ttft']:.1f}x", flush=True)

    med = lambda key: statistics.median(t[key] for t in trials)  # noqa: E731
    prompt_tokens = trials[0]["prompt_tokens"]
    cached = trials[0]["alora_cached_tokens"]
    alora_new, lora_new = prompt_tokens - cached, prompt_tokens - trials[0]["lora_cached_tokens"]
    floors = {"alora": floor.seconds(alora_new, cached), "lora": floor.seconds(lora_new, prompt_tokens - lora_new),
              "base_turn": floor.seconds(args.conversation_len)}
    result = {
        "trials": trials, "prompt_tokens": prompt_tokens,
        "alora_ttft_median": med("alora_ttft"), "lora_ttft_median": med("lora_ttft"),
        "base_turn_ttft_median": med("base_turn_ttft"),
        "lora_over_alora": med("lora_ttft") / med("alora_ttft"),
        "ratio_per_trial": [t["lora_ttft"] / t["alora_ttft"] for t in trials],
        "floor_seconds": floors,
    }
    rows = [
        ("base turn (conversation)", args.conversation_len, 0, f"{med('base_turn_ttft') * 1e3:.1f}",
         f"{floors['base_turn'] * 1e3:.1f}", f"{med('base_turn_ttft') / floors['base_turn']:.1f}", ""),
        ("aLoRA", prompt_tokens, cached, f"{med('alora_ttft') * 1e3:.1f}", f"{floors['alora'] * 1e3:.1f}",
         f"{med('alora_ttft') / floors['alora']:.1f}", "1.0"),
        ("plain LoRA (same weights)", prompt_tokens, trials[0]["lora_cached_tokens"],
         f"{med('lora_ttft') * 1e3:.1f}", f"{floors['lora'] * 1e3:.1f}", f"{med('lora_ttft') / floors['lora']:.1f}",
         f"{result['lora_over_alora']:.1f}"),
    ]
    print_table(f"(a) Time to first token after a base turn: {args.conversation_len}-token conversation + "
                f"{args.answer_len}-token answer + {len(invocation)}-token invocation, median of {args.trials} "
                f"(target: LoRA/aLoRA >= 30x)", rows,
                ("request", "prompt tokens", "cached", "TTFT ms", "floor ms", "x floor", "x aLoRA"))
    return result


# ------------------------------------------------------------------ (b) mixed-adapter throughput
def throughput_benchmark(llm: LLM, args, aloras: list[LoRARequest], loras: list[LoRARequest],
                         invocations: list[list[int]], floor: Floor) -> dict:
    config = llm.llm_engine.model_config.hf_config
    rng = random.Random(7)
    low = min(100, config.vocab_size - 1)
    prompts, out_lens, mixed = [], [], []
    for i in range(args.num_prompts):
        kind = ("base", "lora", "base", "alora")[i % 4]  # half base, a quarter each adapter kind
        which = (i // 4) % len(aloras)
        n = rng.randint(*args.input_len)
        invocation = invocations[which]
        prompts.append([rng.randrange(low, config.vocab_size) for _ in range(max(1, n - len(invocation)))] + invocation)
        out_lens.append(rng.randint(*args.output_len))
        mixed.append({"base": None, "lora": loras[which], "alora": aloras[which]}[kind])
    params = [greedy(n) for n in out_lens]
    tokens = sum(len(p) for p in prompts) + sum(out_lens)
    flops = sum(forward_flops(config, len(p)) + sum(forward_flops(config, 1, len(p) + j) for j in range(n - 1))
                for p, n in zip(prompts, out_lens))
    runs = {"base": [], "mixed": []}
    for rep in range(args.repeats):
        for name, loras_arg in (("base", None), ("mixed", mixed)):
            llm.llm_engine.engine_core.reset_prefix_cache()
            outputs, seconds = timed(llm, prompts, params, loras_arg, bar=True)
            assert all(len(o.outputs[0].token_ids) == n for o, n in zip(outputs, out_lens))
            runs[name].append(seconds)
            print(f"repeat {rep}: {name} {seconds:.2f} s ({tokens / seconds:.1f} tokens/s)", flush=True)
    best = {k: min(v) for k, v in runs.items()}
    ratio = best["base"] / best["mixed"]
    per_repeat = [b / m for b, m in zip(runs["base"], runs["mixed"])]
    floor_s = flops / floor.flops
    rows = [(name, f"{best[name]:.2f}", f"{tokens / best[name]:.1f}", f"{floor_s / best[name]:.2f}",
             f"{best['base'] / best[name]:.2f}") for name in ("base", "mixed")]
    print_table(f"(b) Throughput: {args.num_prompts} requests, {tokens} tokens; mixed = 1/4 plain LoRA + 1/4 aLoRA "
                f"over {len(aloras)}+{len(loras)} adapters (rank {args.rank}, {len(args.targets)} targets), "
                f"best of {args.repeats} (target: mixed >= 0.85 of base)", rows,
                ("run", "seconds", "tokens/s", "FLOP floor / time", "x base throughput"))
    return {"num_prompts": args.num_prompts, "tokens": tokens, "flops": flops, "seconds": runs, "best": best,
            "mixed_over_base_throughput": ratio, "ratio_per_repeat": per_repeat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--only", choices=("ttft", "throughput"), default=None, help="run one part")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=ALL_TARGETS, help="modules the adapters adapt")
    parser.add_argument("--conversation-len", type=int, default=2048, help="(a) conversation tokens")
    parser.add_argument("--answer-len", type=int, default=32, help="(a) tokens of the base turn's answer")
    parser.add_argument("--trials", type=int, default=3, help="(a) fresh conversations")
    parser.add_argument("--num-prompts", type=int, default=64, help="(b) requests per run")
    parser.add_argument("--num-adapters", type=int, default=2, help="(b) distinct aLoRAs (and as many plain LoRAs)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=2, help="(b) base/mixed pairs")
    args = parser.parse_args()
    device = default_device()
    root = tempfile.mkdtemp(prefix="vllm-bench-adapters-")
    model_dir, kwargs = resolve_model(args, root)
    max_len = max(4096, args.conversation_len + args.answer_len + 64)
    llm = LLM(model_dir, enable_lora=True, max_loras=2 * args.num_adapters, max_lora_rank=args.rank,
              max_model_len=max_len, **kwargs)
    config = llm.llm_engine.model_config
    tokenizer = llm.get_tokenizer()
    dtype = config.dtype
    invocations, aloras, loras = [], [], []
    for i in range(args.num_adapters):
        name = INTRINSIC_NAMES[i % len(INTRINSIC_NAMES)]
        invocation = invocation_ids(tokenizer, name)
        a, lo = write_adapter_pair(root, config.hf_config, name, args.rank, args.targets, seed=i, invocation=invocation,
                                   dtype=dtype)
        invocations.append(invocation)
        aloras.append(LoRARequest(f"alora-{name}", 2 * i + 1, a))
        loras.append(LoRARequest(f"lora-{name}", 2 * i + 2, lo))
    # Warm-up: every adapter loaded into its slot, every path run once.
    warm = [list(range(200, 240)) + inv for inv in invocations]
    llm.generate([{"prompt_token_ids": p} for p in warm * 3], greedy(2), use_tqdm=False,
                 lora_request=[None] * len(warm) + aloras + loras)
    llm.llm_engine.engine_core.reset_prefix_cache()
    floor = Floor(config.hf_config, dtype, device)
    load_before = machine_load()
    print(f"{device}, {load_line(load_before)}; floor: {floor.flops / 1e9:.1f} GFLOP/s matmul, "
          f"{floor.bandwidth / 1e9:.1f} GB/s copy, {floor.bytes / 1e6:.0f} MB of weights per step")
    results = {"device": device, "model": model_dir, "dtype": str(dtype), "rank": args.rank, "targets": args.targets,
               "floor": floor.as_dict(), "load_before": load_before}
    if args.only in (None, "ttft"):
        results["ttft"] = ttft_benchmark(llm, args, aloras[0], loras[0], invocations[0], floor)
    if args.only in (None, "throughput"):
        results["throughput"] = throughput_benchmark(llm, args, aloras, loras, invocations, floor)
    results["load_after"] = machine_load()
    print(f"\n{load_line(results['load_after'])}")
    verdicts = []
    if "ttft" in results:
        r = results["ttft"]["lora_over_alora"]
        verdicts.append(f"aLoRA TTFT {r:.1f}x lower than plain LoRA (target 30x: {'met' if r >= 30 else 'missed'})")
    if "throughput" in results:
        r = results["throughput"]["mixed_over_base_throughput"]
        verdicts.append(f"mixed-adapter throughput {r:.2f} of base (target 0.85: {'met' if r >= 0.85 else 'missed'})")
    for line in verdicts:
        print(line)
    save_json(args.json, results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
