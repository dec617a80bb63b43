"""Weight-only quantization on the CPU, per precision: the bytes of the linear weights and of the
LM head (int8 per channel under both methods), the batch-1 decode step against its floor (those
bytes read once at the measured bandwidth: the fastest of reads and a copy),
and agreement with the fp32 model (greedy tokens on a fixed prompt set, mean |logprob|
difference of the prompt tokens, teacher-forced so one early divergence does not decide it).
Quantized layers round activations to int8 per block of 32 (see quantization.py) on every
path, so the teacher-forced prefill measures the same numerics the decodes run.

    python -m benchmarks.quantization                 # the packaged SmolLM2-135M-Instruct
    python -m benchmarks.quantization --model DIR --precisions float32 int8 int4

bf16 runs natively only where the CPU has AVX512-BF16 or AMX (elsewhere torch emulates it and
it is slower than fp32): the table says which. Not a test; docs/benchmarks.md records runs.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import gc

import torch

from benchmarks.common import add_model_args, machine_load, measured_bandwidth, print_table, resolve_model, save_json
from benchmarks.engine_steps import decode_step_seconds
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.linear import Linear
from vllm.platforms import cpu_has_native_bf16

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a key-value cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Pride and Prejudice?",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
]
MAX_NEW = 32
CONTEXT = 256


def linear_weight_bytes(llm: LLM) -> int:
    model = llm.llm_engine.engine_core.runner.model
    return sum(module.weight_nbytes for module in model.modules() if isinstance(module, Linear))


def lm_head_bytes(llm: LLM) -> int:
    return llm.llm_engine.engine_core.runner.model.lm_head.weight_nbytes


def outputs(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    prompts = [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    forced = llm.generate([{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids}
                           for p, o in zip(prompts, greedy)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)
    logprobs = [[next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                 for d, t in zip(f.prompt_logprobs[1:], f.prompt_token_ids[1:])] for f in forced]
    return [o.outputs[0].token_ids for o in greedy], logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--precisions", nargs="+", default=["float32", "bfloat16", "int8", "int4"],
                        choices=["float32", "bfloat16", "int8", "int4"])
    args = parser.parse_args()
    model_dir, kwargs = resolve_model(args)
    kwargs.pop("dtype", None)
    start_load = os.getloadavg()[0]  # others' work on the machine slows every figure: print it
    # Measured again after each precision; the floors take the fastest (a shared host's speed
    # moves within minutes, and a floor from its slowest minute flatters every figure).
    bandwidth = measured_bandwidth("cpu")
    measured, reference = [], None
    for precision in ["float32"] + [p for p in args.precisions if p != "float32"]:
        quant = precision if precision.startswith("int") else None
        dtype = "bfloat16" if precision == "bfloat16" else "float32"
        llm = LLM(model_dir, dtype=dtype, quantization=quant, max_model_len=1024, device="cpu", **kwargs)
        weight_bytes, head_bytes = linear_weight_bytes(llm), lm_head_bytes(llm)
        step = decode_step_seconds(llm, 1, CONTEXT, "cpu")
        tokens, logprobs = outputs(llm)
        if reference is None:
            reference = (tokens, logprobs)
        same = sum(a == b for a, b in zip(tokens, reference[0]))
        diffs = [abs(a - b) for ours, ref in zip(logprobs, reference[1]) for a, b in zip(ours, ref)]
        measured.append((precision, weight_bytes, head_bytes, step, same, sum(diffs) / len(diffs)))
        del llm
        gc.collect()
        bandwidth = max(bandwidth, measured_bandwidth("cpu"))
    rows, results = [], {}
    for precision, weight_bytes, head_bytes, step, same, mean_diff in measured:
        floor = (weight_bytes + head_bytes) / bandwidth
        note = "" if precision != "bfloat16" or cpu_has_native_bf16() else " (emulated: no native bf16)"
        rows.append((precision + note, f"{weight_bytes / 2**20:.1f}", f"{head_bytes / 2**20:.1f}",
                     f"{step * 1e3:.2f}", f"{floor * 1e3:.2f}", f"{step / floor:.2f}x", f"{same}/{len(PROMPTS)}",
                     f"{mean_diff:.4f}"))
        results[precision] = dict(linear_weight_bytes=weight_bytes, lm_head_bytes=head_bytes, decode_step_s=step,
                                  floor_s=floor, greedy_equal=same, mean_abs_logprob_diff=mean_diff)
    print_table(f"Weight-only quantization, {os.path.basename(model_dir.rstrip('/'))}, batch-1 decode at "
                f"{CONTEXT} tokens of context, {torch.get_num_threads()} threads, bandwidth "
                f"{bandwidth / 1e9:.1f} GB/s, load average {start_load:.1f} at the start, "
                f"{os.getloadavg()[0]:.1f} at the end",
                rows, ("precision", "linear weights MiB", "LM head MiB", "decode step ms", "floor ms", "vs floor",
                       "greedy = fp32", "mean |dlogprob|"))
    save_json(args.json, {"results": results, "machine_load": machine_load()})


if __name__ == "__main__":
    main()
