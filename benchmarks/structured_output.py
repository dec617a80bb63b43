"""Per-step cost of structured outputs: 32 JSON-schema-constrained requests against 32
unconstrained ones, same prompts, same number of decode steps, in the same run.

    python benchmarks/structured_output.py            # CPU, default model
    python benchmarks/structured_output.py --granite-8b-dummy

Both batches decode exactly `--steps` tokens per request (`ignore_eos`, and a schema
whose strings cannot end early: an array of free text), so the ratio of the two decode
phases is the structured-output overhead per step: grammar bitmask fill, mask
application and token acceptance. Goal: under 10%.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from benchmarks.common import default_device, granite_8b_dummy_dir, print_table, random_prompts, save_json, sync
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
    parser.add_argument("--granite-8b-dummy", action="store_true")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = default_device()
    kwargs = dict(max_model_len=1024, enable_prefix_caching=False)
    if args.granite_8b_dummy:
        model = granite_8b_dummy_dir(tempfile.mkdtemp())
        kwargs["load_format"] = "dummy"
    else:
        from vllm.model_executor.default_model import ensure_default_model

        model = ensure_default_model()
    llm = LLM(model, **kwargs)
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
                          "ms_constrained": best["constrained"] * 1000, "ratio": ratio})


if __name__ == "__main__":
    main()
