"""The native CPU attention kernel (vllm/csrc/cpu/paged_attention.cpp) on its own, against the
machine's floors, in two tables:

  decode  one decode step's attention over every layer's KV cache, caches cold (a buffer larger
          than the last-level cache is read before each step, as a step's weights pass through
          it; a copy would leave dirty lines whose write-back slows the step: 25-30% at batch 1
          on Zen 3): ms, the KV bytes read per second, and the ratio of that rate to this
          machine's read bandwidth (a large sum) and copy bandwidth (the floors take the faster).
  prompt  one layer's prompt attention, the native kernel against the path that runs it otherwise
          (torch_ref: SDPA per sequence), with GFLOP/s for each: whether the kernel's
          MAX_QUERY_LEN (attention/backends/cpu_native.py: every length) holds on this machine.

    python -m benchmarks.cpu_attention                          # SmolLM2-135M's shapes, 1 thread
    python -m benchmarks.cpu_attention --heads 32 --kv-heads 8 --head-size 128 --layers 32  # Llama-8B's
    python -m benchmarks.cpu_attention --dtype bfloat16 --tables decode
    python -m benchmarks.cpu_attention --kv-cache-dtype bfloat16 --tables decode  # fp32 model, bf16 cache

Timings are the lower quartile of repeated runs (this host's neighbours make the upper ones
noise). The block tables are shuffled permutations, as a long-running engine's are.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from benchmarks.common import (load_line, machine_load, measured_copy_bandwidth, measured_read_bandwidth, print_table,
                               save_json)
from vllm.attention.backends import cpu_native, torch_ref
from vllm.attention.metadata import AttentionMetadata

BLOCK_SIZE = 16
FLUSH_BYTES = 64 * 2**20  # more than the last-level cache of the machines this runs on


def lower_quartile(fn: Callable[[], None], reps: int, before: Callable[[], None] = lambda: None) -> float:
    """Seconds of fn, the lower quartile of `reps` runs, `before` run untimed ahead of each."""
    before()
    fn()
    times = []
    for _ in range(reps):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4]


def bandwidths() -> tuple[float, float]:
    """(read, copy) bytes/s of this machine on torch's threads: a large sum and a large copy (the
    engine's floors take the faster of the two: benchmarks.common.measured_bandwidth)."""
    return measured_read_bandwidth("cpu"), measured_copy_bandwidth("cpu")


def paged_inputs(contexts: list[int], query_lens: list[int], heads: int, kv_heads: int, head_size: int,
                 dtype: torch.dtype, seed: int, kv_dtype: torch.dtype | None = None):
    """(query, key, value, kv_cache, meta) for sequences of `contexts` cached tokens plus
    `query_lens` new ones, the new keys and values already stored; the cache in `kv_dtype`
    (default: `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    perm = (torch.randperm(sum(blocks), generator=gen) + 1).int()  # block 0 stays unused
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[first:first + n]
        first += n
    cache = torch.randn(2, sum(blocks) + 1, BLOCK_SIZE, kv_heads, head_size, generator=gen).to(kv_dtype or dtype)
    slots = torch.cat([table[i, torch.arange(c, c + q) // BLOCK_SIZE].long() * BLOCK_SIZE
                       + torch.arange(c, c + q) % BLOCK_SIZE for i, (c, q) in enumerate(zip(contexts, query_lens))])
    n = sum(query_lens)
    query = torch.randn(n, heads, head_size, generator=gen).to(dtype)
    key = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=n, num_decodes=sum(1 for q in query_lens if q == 1), slot_mapping=slots,
        query_start_loc=qsl, seq_lens=lens, block_table=table, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    torch_ref.store_kv(key, value, cache, slots)
    return query, key, value, cache, meta


def decode_rows(args, read_bw: float, copy_bw: float) -> list[dict]:
    dtype, kv_dtype = getattr(torch, args.dtype), getattr(torch, args.kv_cache_dtype)
    flush = torch.ones(FLUSH_BYTES // 4)
    results = []
    for context in args.contexts:
        for batch in args.batches:
            layers = [paged_inputs([context - 1] * batch, [1] * batch, args.heads, args.kv_heads, args.head_size,
                                   dtype, seed=layer, kv_dtype=kv_dtype) for layer in range(args.layers)]
            out = torch.empty_like(layers[0][0])

            def step():
                for query, _, _, cache, meta in layers:
                    cpu_native.paged_attention_rows(out, query, cache, meta.block_table, meta.seq_lens,
                                                    meta.query_start_loc, 1, args.scale)

            seconds = lower_quartile(step, args.reps, before=lambda: flush.sum())
            kv_bytes = (2 * args.layers * batch * context * args.kv_heads * args.head_size
                        * torch.empty((), dtype=kv_dtype).element_size())
            rate = kv_bytes / seconds
            results.append({"context": context, "batch": batch, "ms": seconds * 1e3, "kv_bytes": kv_bytes,
                            "gb_per_s": rate / 1e9, "of_read": rate / read_bw, "of_copy": rate / copy_bw})
    return results


def prompt_rows(args) -> list[dict]:
    dtype, kv_dtype = getattr(torch, args.dtype), getattr(torch, args.kv_cache_dtype)
    results = []
    for spec in args.prompts:
        context, query_len = (int(x) for x in spec.split("+")) if "+" in spec else (0, int(spec))
        query, key, value, cache, meta = paged_inputs([context], [query_len], args.heads, args.kv_heads,
                                                      args.head_size, dtype, seed=0, kv_dtype=kv_dtype)
        out = torch.empty_like(query)
        reps = max(3, min(args.reps, int(args.reps * (512 / query_len) ** 2)))
        native = lower_quartile(lambda: cpu_native.paged_attention_rows(
            out, query, cache, meta.block_table, meta.seq_lens, meta.query_start_loc, 2**31 - 1, args.scale), reps)
        sdpa = lower_quartile(lambda: torch_ref.paged_attention(query, key, value, cache, meta, args.scale), reps)
        reference = torch_ref.paged_attention(query, key, value, cache, meta, args.scale)  # `out`: the timed runs'
        flops = 4 * args.heads * args.head_size * sum(context + j + 1 for j in range(query_len))
        results.append({"context": context, "query_len": query_len, "native_ms": native * 1e3,
                        "sdpa_ms": sdpa * 1e3, "native_gflops": flops / native / 1e9,
                        "sdpa_gflops": flops / sdpa / 1e9, "native_over_sdpa": native / sdpa,
                        "max_abs_diff": (out.float() - reference.float()).abs().max().item()})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", default=["decode", "prompt"], choices=("decode", "prompt"))
    parser.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M's 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30, help="layers a decode step attends over")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--kv-cache-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the cache's dtype (default: --dtype); bfloat16 under float32 is the engine's "
                             "--kv-cache-dtype bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="decode: tokens per sequence")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode: sequences per step")
    parser.add_argument("--prompts", nargs="+", default=["512", "1024", "2048", "4096", "2048+512"],
                        help="prompt: new tokens, or CACHED+NEW")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    args.kv_cache_dtype = args.kv_cache_dtype or args.dtype
    if args.kv_cache_dtype != args.dtype and (args.dtype, args.kv_cache_dtype) != ("float32", "bfloat16"):
        parser.error("--kv-cache-dtype differs from --dtype only as bfloat16 under float32")
    if not cpu_native.is_available():
        parser.error("the native CPU attention kernel is not built here (see vllm/native_build.py)")
    torch.set_num_threads(args.threads)
    args.scale = args.head_size ** -0.5
    cache = "" if args.kv_cache_dtype == args.dtype else f" ({args.kv_cache_dtype} cache)"
    shape = f"{args.heads}/{args.kv_heads} heads of {args.head_size}, {args.dtype}{cache}, {args.threads} threads"
    payload = {"load": machine_load(), "shape": shape}
    if "decode" in args.tables:
        read_bw, copy_bw = bandwidths()
        decode = decode_rows(args, read_bw, copy_bw)
        payload.update(read_gb_per_s=read_bw / 1e9, copy_gb_per_s=copy_bw / 1e9, decode=decode)
        print_table(f"Decode attention, {args.layers} layers, caches cold, {shape} (read {read_bw / 1e9:.1f} GB/s, "
                    f"copy {copy_bw / 1e9:.1f} GB/s)",
                    [(r["context"], r["batch"], f"{r['ms']:.2f}", f"{r['kv_bytes'] / 2**20:.1f}",
                      f"{r['gb_per_s']:.1f}", f"{r['of_read']:.2f}", f"{r['of_copy']:.2f}") for r in decode],
                    ("context", "batch", "ms", "KV MiB", "GB/s", "x read bw", "x copy bw"))
    if "prompt" in args.tables:
        prompt = prompt_rows(args)
        payload["prompt"] = prompt
        print_table(f"Prompt attention, one layer, {shape}",
                    [(r["context"], r["query_len"], f"{r['native_ms']:.2f}", f"{r['native_gflops']:.1f}",
                      f"{r['sdpa_ms']:.2f}", f"{r['sdpa_gflops']:.1f}", f"{r['native_over_sdpa']:.2f}",
                      f"{r['max_abs_diff']:.1e}") for r in prompt],
                    ("cached", "new", "native ms", "GFLOP/s", "SDPA path ms", "GFLOP/s", "native / SDPA",
                     "max |diff|"))
    print(load_line(payload["load"]))
    save_json(args.json, payload)


if __name__ == "__main__":
    main()
