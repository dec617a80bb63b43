"""Offline throughput: our engine against transformers' batched `generate` on the same
prompts, in the same run, and the prefill rate of one long prompt against the
machine's measured matmul rate on the model's own shapes.

    python -m benchmarks.throughput                               # CPU, default ~135M model, uniform lengths
    python -m benchmarks.throughput --lengths longtail            # chat-like long-tailed lengths
    python -m benchmarks.throughput --granite-8b-dummy            # GPU, Granite-3.3-8B shapes, random bf16 weights

Tokens/s count only the tokens each request asked for (prompt + its own output
length); transformers, which pads a batch and runs until its longest request is
done, is charged for its real wall time on the same useful tokens.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import time

import torch

from benchmarks.common import (
    add_model_args,
    default_device,
    forward_flops,
    linear_shapes,
    machine_load,
    measured_matmul_flops,
    print_table,
    random_prompts,
    resolve_model,
    save_json,
    sync,
)
from vllm import LLM, SamplingParams


def run_ours(llm: LLM, prompts) -> float:
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in prompts]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out for o, (_, out) in zip(outputs, prompts))
    return elapsed


@torch.inference_mode()
def run_transformers(model_dir: str, prompts, batch_size: int, dtype: torch.dtype, device: str) -> float:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id or 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="transformers batches"):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(out for _, out in batch)
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=pad)
    sync(device)
    return time.perf_counter() - start


def prefill_rate(llm: LLM, length: int, device: str) -> tuple[float, float, float]:
    """Seconds for one `length`-token prompt, its FLOP/s, and the matmul FLOP/s."""
    config = llm.llm_engine.model_config
    prompt = list(range(100, 100 + length))
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompt[:64]}], one, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(2):
        llm.llm_engine.engine_core.reset_prefix_cache()
        sync(device)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        sync(device)
        best = min(best, time.perf_counter() - start)
    achieved = forward_flops(config.hf_config, length) / best
    peak = max(measured_matmul_flops(linear_shapes(config.hf_config), length, config.dtype, device) for _ in range(3))
    return best, achieved, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--lengths", choices=("uniform", "longtail"), default="uniform",
                        help="length distribution within the ranges")
    parser.add_argument("--prefill-len", type=int, default=2000)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args()
    device = default_device()
    model_dir, kwargs = resolve_model(args)
    if args.granite_8b_dummy:
        args.no_hf = True  # random weights: transformers would need its own 16 GB copy
    llm = LLM(model_dir, max_model_len=max(4096, args.prefill_len + 16), **kwargs)
    config = llm.llm_engine.model_config
    prompts = random_prompts(config.vocab_size, args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                             lengths=args.lengths)
    useful = sum(len(p) + out for p, out in prompts)
    generated = sum(out for _, out in prompts)
    results = {"device": device, "model": model_dir, "lengths": args.lengths, "num_prompts": len(prompts),
               "machine": machine_load()}

    rows = []
    ours = run_ours(llm, prompts)
    rows.append(("ours", f"{ours:.2f}", f"{useful / ours:.1f}", f"{generated / ours:.1f}", "1.00"))
    results.update(ours_seconds=ours, ours_tokens_per_s=useful / ours)
    if not args.no_hf:
        hf = run_transformers(model_dir, prompts, args.hf_batch_size, config.dtype, device)
        rows.append(("transformers", f"{hf:.2f}", f"{useful / hf:.1f}", f"{generated / hf:.1f}", f"{hf / ours:.2f}"))
        results.update(hf_seconds=hf, hf_tokens_per_s=useful / hf, speedup_vs_hf=hf / ours)
    print_table(f"Throughput: {len(prompts)} requests ({args.lengths} lengths), {useful} tokens ({generated} "
                f"generated), {device}, {torch.get_num_threads()} threads", rows,
                ("engine", "seconds", "tokens/s", "gen tokens/s", "ours faster by"))

    seconds, achieved, peak = prefill_rate(llm, args.prefill_len, device)
    print_table(f"Prefill of one {args.prefill_len}-token prompt", [(
        f"{seconds * 1000:.0f}", f"{achieved / 1e9:.1f}", f"{peak / 1e9:.1f}", f"{achieved / peak:.2f}")],
        ("ms", "achieved GFLOP/s", "matmul GFLOP/s (same shapes, best implementation)", "ratio to floor"))
    results.update(prefill_seconds=seconds, prefill_flops=achieved, matmul_flops=peak, prefill_ratio=achieved / peak)
    save_json(args.json, results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
