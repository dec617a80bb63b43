"""GPU kernel check and timing: every Triton kernel against its torch reference on fresh
random bf16 inputs at Granite-3.3-8B shapes, timed against its roofline floor.

    python -m benchmarks.triton_kernels           # needs a CUDA GPU; well under 2 minutes on an H200

Each row: kernel, shape, median ms (triton.testing.do_bench, L2 flushed between runs),
floor ms = max(bytes moved / HBM bandwidth, FLOPs / bf16 dense peak), ratio = ms / floor,
the torch reference's ms in the same process, and the max error vs an fp32 reference.
The floor uses datasheet peaks (H200: 4.8 TB/s, 989 TFLOP/s); the header also prints the
copy bandwidth and matmul rate measured here, for context.

rms_norm and rotary are checked against the model layers' torch code.
Two extra rows replay CUDA graphs (decode attention, BGMV LoRA) after refilling their
input buffers with new values, proving the captured kernels read fresh data.
A row that raises prints its error and the run continues.
"""

from __future__ import annotations

import math
import os
import sys
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HBM_BYTES_PER_S = 4.8e12
PEAK_FLOPS = 989e12
# Granite-3.3-8B
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, INTERMEDIATE = 4096, 32, 8, 128, 12800
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
ROWS: list[tuple] = []


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def floor_ms(num_bytes: float, flops: float) -> float:
    return 1e3 * max(num_bytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS)


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max())


def record(kernel, shape, fn, ref_fn, num_bytes, flops, err, tol):
    ms = bench(fn)
    ref_ms = bench(ref_fn) if ref_fn is not None else float("nan")
    fl = floor_ms(num_bytes, flops)
    ROWS.append((kernel, shape, ms, fl, ms / fl, ref_ms, err, "ok" if err <= tol else "FAIL"))


# ---------------------------------------------------------------- attention


def make_attention_batch(specs, seed):
    """specs: [(context_len, query_len)], decodes first. Returns inputs and metadata with
    shuffled block ids and the context already in the cache."""
    from vllm.attention.metadata import AttentionMetadata

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    nblocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    total_blocks = sum(nblocks) + 1
    perm = torch.randperm(total_blocks, device=dev, generator=gen).int()
    table = torch.zeros(len(specs), max(nblocks), dtype=torch.int32, device=dev)
    offsets = np.concatenate([[0], np.cumsum(nblocks)])
    for i, nb in enumerate(nblocks):
        table[i, :nb] = perm[offsets[i] : offsets[i] + nb]
    cache = torch.randn(2, total_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=dev, dtype=DTYPE, generator=gen)
    slots = []
    for i, (ctx, q) in enumerate(specs):
        pos = torch.arange(ctx, ctx + q, device=dev)
        slots.append(table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    n = sum(q for _, q in specs)
    query = torch.randn(n, NUM_HEADS, HEAD_SIZE, device=dev, dtype=DTYPE, generator=gen)
    key = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, device=dev, dtype=DTYPE, generator=gen)
    value = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, device=dev, dtype=DTYPE, generator=gen)
    qsl = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=n,
        num_decodes=next((i for i, (_, q) in enumerate(specs) if q > 1), len(specs)),
        slot_mapping=torch.cat(slots),
        query_start_loc=qsl.to(dev),
        seq_lens=lens.to(dev),
        block_table=table,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return query, key, value, cache, meta


def attention_counts(specs):
    kv_tokens = sum(c + q for c, q in specs)
    pairs = sum(q * c + q * (q + 1) // 2 for c, q in specs)  # causal (query, key) pairs
    n = sum(q for _, q in specs)
    itemsize = torch.finfo(DTYPE).bits // 8
    num_bytes = itemsize * (2 * kv_tokens * NUM_KV_HEADS * HEAD_SIZE + 2 * n * NUM_HEADS * HEAD_SIZE)
    return num_bytes, 4 * pairs * NUM_HEADS * HEAD_SIZE


def bench_store_kv(num_tokens):
    from vllm.attention.backends import torch_ref, triton_backend

    query, key, value, cache, meta = make_attention_batch([(0, num_tokens)], seed=num_tokens)
    ref = cache.clone()
    torch_ref.store_kv(key, value, ref, meta.slot_mapping)
    triton_backend.store_kv(key, value, cache, meta.slot_mapping)
    err = 0.0 if torch.equal(cache, ref) else float("inf")
    num_bytes = 2 * 2 * key.numel() * key.element_size()  # read k, v; write k, v
    record("store_kv", f"T={num_tokens}", lambda: triton_backend.store_kv(key, value, cache, meta.slot_mapping),
           lambda: torch_ref.store_kv(key, value, ref, meta.slot_mapping), num_bytes, 0, err, 0.0)


def bench_attention(name, specs):
    from vllm.attention.backends import torch_ref, triton_backend

    query, key, value, cache, meta = make_attention_batch(specs, seed=len(specs))
    scale = HEAD_SIZE**-0.5
    triton_backend.store_kv(key, value, cache, meta.slot_mapping)
    out = triton_backend.paged_attention(query, key, value, cache, meta, scale)
    ref = torch_ref.paged_attention(query.float(), key.float(), value.float(), cache.float(), meta, scale)
    err = max_err(out, ref)
    del ref
    num_bytes, flops = attention_counts(specs)
    record(name, _describe(specs), lambda: triton_backend.paged_attention(query, key, value, cache, meta, scale),
           lambda: torch_ref.paged_attention(query, key, value, cache, meta, scale), num_bytes, flops, err, 2e-2)


def _describe(specs):
    groups: dict[tuple, int] = {}
    for s in specs:
        groups[s] = groups.get(s, 0) + 1
    return " + ".join(f"{k}x(ctx {c}, q {q})" for (c, q), k in groups.items())


def check_decode_graph():
    """Capture decode attention, change lengths and block ids in place, replay."""
    from vllm.attention.backends import torch_ref, triton_backend

    specs = [(1000, 1)] * 16
    query, key, value, cache, meta = make_attention_batch(specs, seed=123)
    scale = HEAD_SIZE**-0.5
    triton_backend.paged_attention(query, key, value, cache, meta, scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_backend.paged_attention(query, key, value, cache, meta, scale)
    new_lens = torch.randint(1, 1001, (16,), dtype=torch.int32)
    meta.seq_lens.copy_(new_lens)
    meta.seq_lens_cpu = new_lens
    meta.block_table.copy_(meta.block_table.flip(1).roll(3, dims=0))  # other (valid) blocks
    graph.replay()
    ref = torch_ref.paged_attention(query.float(), key.float(), value.float(), cache.float(), meta, scale)
    err = max_err(out, ref)
    ROWS.append(("decode graph replay", "16 seqs, lens changed", float("nan"), float("nan"), float("nan"),
                 float("nan"), err, "ok" if err <= 2e-2 else "FAIL"))


# ---------------------------------------------------------------- LoRA


def make_lora(slices, rank, num_tokens, num_slots, frac_base, seed):
    from vllm.lora.punica import PunicaWrapper

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    lora_a = [torch.randn(num_slots, rank, HIDDEN, device=dev, dtype=DTYPE, generator=gen) / math.sqrt(HIDDEN)
              for _ in slices]
    lora_b = [torch.randn(num_slots, n, rank, device=dev, dtype=DTYPE, generator=gen) / math.sqrt(rank) for n in slices]
    x = torch.randn(num_tokens, HIDDEN, device=dev, dtype=DTYPE, generator=gen)
    y = torch.randn(num_tokens, sum(slices), device=dev, dtype=DTYPE, generator=gen)
    rng = np.random.default_rng(seed)
    mapping = rng.integers(0, num_slots, size=num_tokens)
    mapping[rng.random(num_tokens) < frac_base] = -1
    punica = PunicaWrapper(num_tokens, dev)
    punica.update(mapping)
    return x, y, lora_a, lora_b, punica, mapping


def bench_lora(name, slices, rank, num_tokens, num_slots=4, frac_base=0.25):
    from vllm.lora.ops import torch_ops, triton_ops

    seed = rank + num_tokens
    x, y, lora_a, lora_b, punica, mapping = make_lora(slices, rank, num_tokens, num_slots, frac_base, seed)
    meta = punica.meta
    variant = "SGMV" if triton_ops.use_sgmv(meta, x) else "BGMV"
    out = y.clone()
    triton_ops.add_lora(out, x, lora_a, lora_b, slices, meta)
    ref = y.float()
    torch_ops.add_lora(ref, x.float(), [a.float() for a in lora_a], [b.float() for b in lora_b], slices, meta)
    base_rows = torch.from_numpy(mapping < 0).to(y.device)
    err = max_err(out, ref)
    if not torch.equal(out[base_rows], y[base_rows]):
        err = float("inf")  # -1 rows must be bit-identical
    adapted = int((mapping >= 0).sum())
    active = len(set(mapping[mapping >= 0].tolist()))
    item = torch.finfo(DTYPE).bits // 8
    num_bytes = item * (num_tokens * HIDDEN + active * rank * (HIDDEN * len(slices) + sum(slices))
                        + 2 * adapted * sum(slices))
    flops = 2 * adapted * rank * (HIDDEN * len(slices) + sum(slices))
    record(f"lora {name} {variant}", f"T={num_tokens} r={rank} out={slices}",
           lambda: triton_ops.add_lora(out, x, lora_a, lora_b, slices, meta),
           lambda: torch_ops.add_lora(y, x, lora_a, lora_b, slices, meta), num_bytes, flops, err, 5e-2)


def check_lora_graph():
    """Capture the op at 128 rows (BGMV is forced by capture), refill the mapping, replay."""
    from vllm.lora.ops import torch_ops, triton_ops

    slices = [HIDDEN, 1024, 1024]
    x, y, lora_a, lora_b, punica, _ = make_lora(slices, 16, 128, 4, 0.25, seed=5)
    out = y.clone()
    triton_ops.add_lora(out, x, lora_a, lora_b, slices, punica.meta, sgmv=False)  # compile BGMV outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    work = y.clone()
    with torch.cuda.graph(graph):
        triton_ops.add_lora(work, x, lora_a, lora_b, slices, punica.meta)
    new_mapping = np.random.default_rng(6).integers(-1, 4, size=128)
    punica.update(new_mapping)
    work.copy_(y)
    graph.replay()
    ref = y.float()
    torch_ops.add_lora(ref, x.float(), [a.float() for a in lora_a], [b.float() for b in lora_b], slices, punica.meta)
    err = max_err(work, ref)
    ROWS.append(("lora graph replay", "T=128, mapping changed", float("nan"), float("nan"), float("nan"),
                 float("nan"), err, "ok" if err <= 5e-2 else "FAIL"))


# ---------------------------------------------------------------- norm and rotary


def bench_rms_norm(num_tokens):
    from vllm.attention.ops.rms_norm import rms_norm
    from vllm.model_executor.layers.layernorm import RMSNorm

    dev = torch.device("cuda")
    norm = RMSNorm(HIDDEN, 1e-5, DTYPE, dev)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(num_tokens, HIDDEN, device=dev, dtype=DTYPE)
    residual = torch.randn_like(x)
    out, summed = rms_norm(x.clone(), norm.weight, norm.eps, residual)
    ref_out, ref_sum = norm(x.clone(), residual)
    err = max(max_err(out, ref_out), max_err(summed, ref_sum))
    work = x.clone()
    num_bytes = 4 * x.numel() * x.element_size()  # read x, residual; write sum, out
    record("rms_norm+residual", f"T={num_tokens} H={HIDDEN}", lambda: rms_norm(work, norm.weight, norm.eps, residual),
           lambda: norm(work, residual), num_bytes, 0, err, 5e-2)


def bench_rotary(num_tokens):
    from vllm.attention.ops.rotary import rotary_embedding
    from vllm.model_executor.layers.rotary import RotaryEmbedding

    dev = torch.device("cuda")
    rope = RotaryEmbedding(HEAD_SIZE, 8192, {"rope_type": "default", "rope_theta": 10000000.0}, DTYPE, dev)
    positions = torch.randint(0, 8192, (num_tokens,), device=dev)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE, device=dev, dtype=DTYPE)
    query = qkv[:, : NUM_HEADS * HEAD_SIZE].view(num_tokens, NUM_HEADS, HEAD_SIZE)
    key = qkv[:, NUM_HEADS * HEAD_SIZE : (NUM_HEADS + NUM_KV_HEADS) * HEAD_SIZE]
    key = key.view(num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    q_out, k_out = rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache)
    ref_q, ref_k = rope(positions, query, key)
    err = max(max_err(q_out, ref_q), max_err(k_out, ref_k))
    num_bytes = 2 * (query.numel() + key.numel()) * query.element_size()
    record("rotary", f"T={num_tokens} heads={NUM_HEADS}+{NUM_KV_HEADS}",
           lambda: rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache),
           lambda: rope(positions, query, key), num_bytes, 0, err, 5e-2)


# ---------------------------------------------------------------- main


def measured_ceilings() -> str:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    mm_ms = bench(lambda: a @ a)
    tb_s = 2 * src.numel() / copy_ms / 1e9
    tflops = 2 * 8192**3 / mm_ms / 1e9
    return f"measured: copy {tb_s:.2f} TB/s, bf16 matmul {tflops:.0f} TFLOP/s"


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_kernels.py needs a CUDA GPU (it times the Triton kernels); none is available here. "
                 "On CPU the kernels are checked by `pytest tests/kernels` under TRITON_INTERPRET=1.")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  floor: {HBM_BYTES_PER_S / 1e12:.1f} TB/s, {PEAK_FLOPS / 1e12:.0f} TFLOP/s; "
          f"{measured_ceilings()}", flush=True)
    cases = [
        (bench_store_kv, 8192),
        (bench_store_kv, 256),
        (bench_attention, "decode", [(4095, 1)] * 64),
        (bench_attention, "decode long", [(32767, 1)] * 8),
        (bench_attention, "prefill", [(0, 2048)] * 4),
        (bench_attention, "chunked prefill", [(6144, 2048)] * 2),
        (bench_attention, "mixed", [(2047, 1)] * 32 + [(0, 1024)] * 2),
        (bench_lora, "qkv", [HIDDEN, 1024, 1024], 16, 4096),
        (bench_lora, "qkv", [HIDDEN, 1024, 1024], 64, 4096),
        (bench_lora, "gate_up", [INTERMEDIATE, INTERMEDIATE], 64, 4096),
        (bench_lora, "qkv", [HIDDEN, 1024, 1024], 64, 64),
        (bench_lora, "gate_up", [INTERMEDIATE, INTERMEDIATE], 64, 64),
        (bench_rms_norm, 8192),
        (bench_rotary, 8192),
        (check_decode_graph,),
        (check_lora_graph,),
    ]
    for fn, *args in cases:
        try:
            fn(*args)
        except Exception as exc:  # keep going: one broken row must not hide the others
            traceback.print_exc()
            ROWS.append((fn.__name__, repr(args)[:40], *([float("nan")] * 5), f"ERROR {type(exc).__name__}"))
        torch.cuda.empty_cache()
        print(f"  done: {fn.__name__} {repr(args)[:60]}", flush=True)

    header = ("kernel", "shape", "ms", "floor ms", "ratio", "torch ms", "max err", "check")
    table = [header] + [(k, s, f"{ms:.4f}", f"{fl:.4f}", f"{r:.2f}", f"{rm:.4f}", f"{e:.2e}", c)
                        for k, s, ms, fl, r, rm, e, c in ROWS]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    if any(row[-1] != "ok" for row in ROWS):
        sys.exit(1)


if __name__ == "__main__":
    main()
