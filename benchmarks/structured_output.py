"""Per-step cost of structured outputs: 32 JSON-schema-constrained requests against 32
unconstrained ones, same prompts, same number of decode steps, in the same run.

    python -m benchmarks.structured_output            # CPU, default model
    python -m benchmarks.structured_output --granite-8b-dummy

Both batches decode exactly `--steps` tokens per request (`ignore_eos`, and a schema
whose strings cannot end early: an array of free text), so the ratio of the two decode
phases is the structured-output overhead per step: grammar bitmask fill, mask
application and token acceptance. Goal: under 10%.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import time

from benchmarks.common import (
    add_model_args,
    default_device,
    machine_load,
    print_table,
    random_prompts,
    resolve_model,
    save_json,
    sync,
)
from vllm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"]}


def decode_seconds(llm: LLM, prompts, params: SamplingParams, device: str) -> float:
    """Wall time of the decode phase only (prefill done in a first step)."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    engine.step()  # all prompts fit in one step's budget: this is the prefill
    sync(device)
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync(device)
    return (time.perf_counter() - start) / max(steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = default_device()
    model, kwargs = resolve_model(args)
    llm = LLM(model, max_model_len=1024, enable_prefix_caching=False, **kwargs)
    prompts = [p for p, _ in random_prompts(llm.llm_engine.model_config.vocab_size, args.num_requests,
                                            (args.prompt_len, args.prompt_len), (1, 1))]
    free = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    decode_seconds(llm, prompts[:4], free, device)  # warm-up (and grammar compile below)
    decode_seconds(llm, prompts[:4], constrained, device)
    best = {"unconstrained": float("inf"), "constrained": float("inf")}
    for _ in range(args.repeats):  # interleaved, min of repeats: robust to a noisy machine
        best["unconstrained"] = min(best["unconstrained"], decode_seconds(llm, prompts, free, device))
        best["constrained"] = min(best["constrained"], decode_seconds(llm, prompts, constrained, device))
    ratio = best["constrained"] / best["unconstrained"]
    print_table(f"Decode step, {args.num_requests} requests, {device}", [
        ("unconstrained", f"{best['unconstrained'] * 1000:.1f}", "1.00"),
        ("JSON schema", f"{best['constrained'] * 1000:.1f}", f"{ratio:.3f}"),
    ], ("batch", "ms per step", "ratio"))
    print(f"structured-output overhead per step: {100 * (ratio - 1):+.1f}% (goal: under +10%)")
    save_json(args.json, {"device": device, "ms_unconstrained": best["unconstrained"] * 1000,
                          "ms_constrained": best["constrained"] * 1000, "ratio": ratio, "machine": machine_load()})


if __name__ == "__main__":
    main()
