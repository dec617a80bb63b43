"""The intrinsic pipeline at this machine's floor: how much faster aLoRA intrinsics make a
whole pipeline than plain LoRA ones could ever be here, against the base answer's length
and the number of conversations per batch. No engine runs; only the floor is measured.

    python -m benchmarks.pipeline_floor                        # CPU, default ~135M model
    python -m benchmarks.pipeline_floor --context-len 8192     # other conversation lengths
    python -m benchmarks.pipeline_floor --granite-8b-dummy     # GPU, Granite-3.3-8B shapes

The pipeline is alora_pipeline.py's: per conversation a base turn (the prefill of the
conversation, then the answer's decode steps), then K intrinsics one after another, each
the prefill of its uncached tokens and its decode steps. The aLoRA intrinsic finds the
conversation and the answer in the cache up to the last full block before its invocation;
the plain LoRA recomputes all of it. Each stage of a round runs as one batch (the weights
read once per step), as with `alora_pipeline.py --concurrency C`. The ratio at the floor
bounds what any engine can show on this machine for that workload: a target above it is a
target for another workload or another machine.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse

from benchmarks.alora_pipeline import Call, stage_floor
from benchmarks.common import Floor, add_model_args, default_device, engine_dtype, load_hf_config, print_table, \
    resolve_model, save_json


def round_floor(floor: Floor, mode: str, conversations: int, context_len: int, answer_len: int, num_intrinsics: int,
                intrinsic_len: int, invocation_len: int, block_size: int) -> float:
    """Floor seconds per conversation of one round: the base turns as one stage, then each
    intrinsic over all the round's answers as one stage."""
    base = [Call(mode, i, 0, 0, "base turn", context_len, 0, answer_len, 0.0, 0.0) for i in range(conversations)]
    prompt = context_len + answer_len + invocation_len
    # The base turn computed every token but its last output's; full blocks of that are cached.
    cached = 0 if mode == "lora" else (context_len + answer_len - 1) // block_size * block_size
    # The intrinsics' stages are alike: each finds the same cached prefix.
    stage = [Call(mode, i, 0, 1, "intrinsic", prompt, cached, intrinsic_len, 0.0, 0.0) for i in range(conversations)]
    return (stage_floor(floor, base) + num_intrinsics * stage_floor(floor, stage)) / conversations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--context-len", type=int, default=2048, help="conversation tokens")
    parser.add_argument("--answer-lens", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="conversations per batch")
    parser.add_argument("--num-intrinsics", type=int, default=3)
    parser.add_argument("--intrinsic-len", type=int, default=16, help="output tokens of each intrinsic")
    parser.add_argument("--invocation-len", type=int, default=6,
                        help="tokens after the answer: end of turn plus the invocation")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--target", type=float, default=3.0, help="the ratio to mark")
    args = parser.parse_args()
    device = default_device()
    model_dir, _ = resolve_model(args)
    floor = Floor(load_hf_config(model_dir), engine_dtype(args, model_dir), device)
    ratios = {}
    for c in args.concurrency:
        for a in args.answer_lens:
            lora, alora = (round_floor(floor, mode, c, args.context_len, a, args.num_intrinsics, args.intrinsic_len,
                                       args.invocation_len, args.block_size) for mode in ("lora", "alora"))
            ratios[(c, a)] = lora / alora
    rows = [(c, *(f"{ratios[(c, a)]:.2f}" + (" *" if ratios[(c, a)] >= args.target else "") for a in args.answer_lens))
            for c in args.concurrency]
    print_table(f"Pipeline at the floor ({device}, {os.path.basename(model_dir)}, {floor.flops / 1e9:.0f} GFLOP/s, "
                f"{floor.bandwidth / 1e9:.1f} GB/s): plain-LoRA / aLoRA seconds per conversation, "
                f"{args.context_len}-token conversations, {args.num_intrinsics} intrinsics x {args.intrinsic_len} "
                f"tokens; * = at least {args.target:g}x", rows,
                ("conversations per batch", *(f"answer {a}" for a in args.answer_lens)))
    save_json(args.json, {"floor": floor.as_dict(), "args": vars(args),
                          "ratios": [{"concurrency": c, "answer_len": a, "ratio": r} for (c, a), r in ratios.items()]})


if __name__ == "__main__":
    main()
