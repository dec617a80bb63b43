"""Offline throughput: our engine against transformers' batched `generate` on the same
prompts, in the same run, and the prefill rate of one long prompt against the
machine's measured matmul rate on the model's own shapes.

    python -m benchmarks.throughput                               # CPU, default ~135M model, uniform lengths
    python -m benchmarks.throughput --lengths longtail            # chat-like long-tailed lengths
    python -m benchmarks.throughput --granite-8b-dummy            # GPU, Granite-3.3-8B shapes, random bf16 weights
    python -m benchmarks.throughput --families mixtral gemma2     # tiny random MoE and Gemma 2 checkpoints
    python -m benchmarks.throughput --precision int4              # our engine on int4 weights (transformers: fp32)
    python -m benchmarks.throughput --precision int4 --kv-cache-dtype bfloat16   # and a bf16 KV cache

`--families` builds a small random checkpoint per family (written with transformers'
`save_pretrained` next to the test tokenizer, like tests/utils/checkpoints.py), runs
each against transformers in this one run, and times one MoE layer of each MoE family
against its floor: the experts a step routes to must have their weights read once
(bytes / the measured bandwidth), and their matmuls take at least FLOPs / the
measured matmul rate on those shapes; the larger of the two is the floor.

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
    best_time,
    engine_kwargs,
    add_model_args,
    default_device,
    forward_flops,
    linear_shapes,
    load_hf_config,
    load_line,
    machine_load,
    measured_bandwidth,
    measured_matmul_flops,
    print_table,
    random_prompts,
    resolve_model,
    save_json,
    sync,
)
from benchmarks.engine_steps import PRECISIONS
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


def compare_with_transformers(llm: LLM, model_dir: str, prompts, args, device: str, label: str = "") -> dict:
    """Our engine and transformers on the same prompts: prints the table, returns the figures."""
    config = llm.llm_engine.model_config
    useful = sum(len(p) + out for p, out in prompts)
    generated = sum(out for _, out in prompts)
    rows, results = [], {}
    ours = run_ours(llm, prompts)
    rows.append(("ours", f"{ours:.2f}", f"{useful / ours:.1f}", f"{generated / ours:.1f}", "1.00"))
    results.update(ours_seconds=ours, ours_tokens_per_s=useful / ours)
    if not args.no_hf:
        hf = run_transformers(model_dir, prompts, args.hf_batch_size, config.dtype, device)
        rows.append(("transformers", f"{hf:.2f}", f"{useful / hf:.1f}", f"{generated / hf:.1f}", f"{hf / ours:.2f}"))
        results.update(hf_seconds=hf, hf_tokens_per_s=useful / hf, speedup_vs_hf=hf / ours)
    print_table(f"Throughput{label}: {len(prompts)} requests ({args.lengths} lengths), {useful} tokens ({generated} "
                f"generated), {device}, {torch.get_num_threads()} threads", rows,
                ("engine", "seconds", "tokens/s", "gen tokens/s", "ours faster by"))
    return results


# ----------------------------------------------------------------- tiny family checkpoints (--families)
MOE_FAMILIES = ("mixtral", "olmoe", "granite4_moe")
FAMILIES = MOE_FAMILIES + ("gemma2",)


def family_config(family: str, hidden: int, layers: int, experts: int, top_k: int, vocab_size: int, eos: int):
    """A transformers config of `family` at a small shape: 8 heads (4 KV heads), experts of
    twice the hidden size, Gemma 2's MLP four times it."""
    from transformers import Gemma2Config, GraniteMoeHybridConfig, MixtralConfig, OlmoeConfig

    heads = 8
    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=heads // 2, max_position_embeddings=4096, vocab_size=vocab_size,
                 bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    moe = dict(intermediate_size=2 * hidden, num_experts_per_tok=top_k)
    if family == "mixtral":
        return MixtralConfig(**shape, **moe, num_local_experts=experts, sliding_window=None)
    if family == "olmoe":
        return OlmoeConfig(**shape, **moe, num_experts=experts, clip_qkv=8.0)
    if family == "granite4_moe":  # experts next to a shared MLP, attention layers only
        return GraniteMoeHybridConfig(**shape, **moe, num_local_experts=experts, shared_intermediate_size=hidden,
                                      layer_types=["attention"] * layers, position_embedding_type="rope")
    if family == "gemma2":  # sliding and global layers alternate; both soft caps on
        return Gemma2Config(**shape, intermediate_size=4 * hidden, head_dim=hidden // heads,
                            query_pre_attn_scalar=hidden // heads, sliding_window=64)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def family_checkpoint(root: str, family: str, args) -> str:
    """A random fp32 checkpoint of `family` plus the test tokenizer, as tests/utils/checkpoints.py writes them."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tests.utils.tokenizer import save_tokenizer

    path = os.path.join(root, family)
    os.makedirs(path, exist_ok=True)
    tok = save_tokenizer(path)
    experts, top_k = args.family_experts
    config = family_config(family, args.family_hidden, args.family_layers, experts, top_k, len(tok),
                           tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                     pad_token_id=tok.eos_token_id).save_pretrained(path)
    return path


@torch.inference_mode()
def moe_layer_vs_floor(llm: LLM, token_counts: list[int], device: str) -> list[dict]:
    """One MoE layer of the loaded model (router, experts, any shared MLP) on random
    hidden states of each size, against its floor: the weights of the experts the
    tokens route to (plus router and shared MLP) read once over the measured copy
    bandwidth, or the step's FLOPs over the matmul rate measured on the expert shapes
    at the tokens each expert gets, whichever is larger."""
    from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts

    model = llm.llm_engine.engine_core.runner.model
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    opts = moe.options
    w13, w2 = moe.experts.w13.weight, moe.experts.w2.weight  # [E, 2I, H], [E, H, I]
    hidden, inter, elem = w13.shape[2], w2.shape[2], w13.element_size()
    expert_params = w13[0].numel() + w2[0].numel()
    # Router and shared MLP: every token uses all of them.
    dense_params = moe.gate.weight.numel() + sum(
        p.numel() for p in (moe.shared_mlp.parameters() if moe.shared_mlp is not None else ()))
    bandwidth = max(measured_bandwidth(device) for _ in range(3))
    rows = []
    for n in token_counts:
        x = torch.randn(n, hidden, dtype=w13.dtype, device=device)  # [n, hidden]
        _, ids = select_experts(moe.gate(x), opts.top_k, opts.scoring, opts.renormalize)
        touched = int(ids.unique().numel())
        seconds = best_time(lambda: moe(x), device, reps=20)
        num_bytes = (touched * expert_params + dense_params + 2 * x.numel()) * elem  # weights, x in, out
        flops = 2.0 * n * (opts.top_k * expert_params + dense_params)
        per_expert = max(1, n * opts.top_k // touched)
        rate = max(measured_matmul_flops([(hidden, 2 * inter), (inter, hidden)], per_expert, w13.dtype, device)
                   for _ in range(3))  # best of a few: a slow try measures the neighbours
        memory, compute = num_bytes / bandwidth, flops / rate
        rows.append({"tokens": n, "experts_touched": touched, "num_experts": opts.num_experts, "seconds": seconds,
                     "floor_seconds": max(memory, compute), "bound": "memory" if memory >= compute else "compute",
                     "bytes": num_bytes, "flops": flops, "bandwidth_bytes_per_s": bandwidth,
                     "matmul_flops": rate})
    return rows


def run_families(args, device: str) -> dict:
    """--families: each family's tiny checkpoint against transformers, and each MoE layer against its floor."""
    import tempfile

    from vllm.model_executor.models import supported_architectures

    kwargs = engine_kwargs(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm-bench-families-") as root:
        for family in args.families:
            path = family_checkpoint(root, family, args)
            architecture = load_hf_config(path).architectures[0]
            if architecture not in supported_architectures():
                print(f"\n{family}: {architecture} is not served by this engine yet; skipped")
                continue
            llm = LLM(path, max_model_len=args.input_len[1] + args.output_len[1] + 16, **kwargs)
            prompts = random_prompts(llm.llm_engine.model_config.vocab_size, args.num_prompts,
                                     tuple(args.input_len), tuple(args.output_len), lengths=args.lengths)
            results[family] = compare_with_transformers(llm, path, prompts, args, device, f" ({family})")
            if family in MOE_FAMILIES:
                layer = moe_layer_vs_floor(llm, args.moe_tokens, device)
                rows = [(r["tokens"], r["experts_touched"], f"{r['seconds'] * 1e3:.3f}",
                         f"{r['floor_seconds'] * 1e3:.3f}", r["bound"], f"{r['seconds'] / r['floor_seconds']:.2f}")
                        for r in layer]
                print_table(f"One MoE layer ({family}, {layer[0]['num_experts']} experts, top "
                            f"{args.family_experts[1]}, hidden {args.family_hidden})", rows,
                            ("tokens", "experts touched", "ms", "floor ms", "floor bound by", "ratio to floor"))
                results[family]["moe_layer"] = layer
            del llm
    return results


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
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=None,
                        help="instead of one model: a small random checkpoint of each family (MoE layers also "
                             "timed against their floor)")
    parser.add_argument("--family-hidden", type=int, default=256, help="--families: hidden size")
    parser.add_argument("--family-layers", type=int, default=4, help="--families: decoder layers")
    parser.add_argument("--family-experts", type=int, nargs=2, default=(8, 2), metavar=("EXPERTS", "TOP_K"),
                        help="--families: experts per MoE layer and experts per token")
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 8, 64, 512],
                        help="--families: batch sizes (tokens) the MoE layer is timed at")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=None,
                        help="our engine's precision (int8/int4: quantized at load, on the --dtype model); "
                             "transformers runs the checkpoint in the model dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16"),
                        help="our engine's KV cache (the engine option of that name)")
    args = parser.parse_args()
    if args.precision and args.dtype and PRECISIONS[args.precision][0]:
        parser.error("--precision fp32/bf16 sets the dtype itself; --dtype goes with int8/int4 only")
    device = default_device()
    if args.families:
        families = run_families(args, device)  # sets the threads that machine_load reports
        results = {"device": device, "lengths": args.lengths, "num_prompts": args.num_prompts,
                   "machine": machine_load(), "families": families}
        print(f"\n{load_line(results['machine'])}")
        save_json(args.json, results)
        return
    model_dir, kwargs = resolve_model(args)
    if args.precision:
        dtype, quantization = PRECISIONS[args.precision]
        if dtype:
            kwargs["dtype"] = dtype
        if quantization:
            kwargs["quantization"] = quantization
    kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.dummy:
        args.no_hf = True  # random weights: transformers would need its own copy (16 GB at 8B)
    llm = LLM(model_dir, max_model_len=max(4096, args.prefill_len + 16), **kwargs)
    config = llm.llm_engine.model_config
    prompts = random_prompts(config.vocab_size, args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                             lengths=args.lengths)
    results = {"device": device, "model": model_dir, "lengths": args.lengths, "num_prompts": len(prompts),
               "precision": args.precision, "kv_cache_dtype": args.kv_cache_dtype, "machine": machine_load()}
    results.update(compare_with_transformers(llm, model_dir, prompts, args, device))

    seconds, achieved, peak = prefill_rate(llm, args.prefill_len, device)
    print_table(f"Prefill of one {args.prefill_len}-token prompt", [(
        f"{seconds * 1000:.0f}", f"{achieved / 1e9:.1f}", f"{peak / 1e9:.1f}", f"{achieved / peak:.2f}")],
        ("ms", "achieved GFLOP/s", "matmul GFLOP/s (same shapes, best implementation)", "ratio to floor"))
    results.update(prefill_seconds=seconds, prefill_flops=achieved, matmul_flops=peak, prefill_ratio=achieved / peak)
    save_json(args.json, results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
