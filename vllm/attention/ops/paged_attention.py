"""Triton paged attention over the KV cache: a split-K decode kernel and a tiled
prefill kernel (flash-attention style online softmax), both reading keys and values
through the block table.

Semantics (identical to vllm/attention/backends/torch_ref.paged_attention):
    for sequence i with KV length L = seq_lens[i] and query length q, query token j
    (row query_start_loc[i] + j) sits at position p = L - q + j and
        out[row, h] = softmax(scale * q[row, h] . K[0..p, h // G]) @ V[0..p, h // G]
    where G = num_heads // num_kv_heads (GQA) and K/V of position x live at flat slot
    block_table[i, x // block_size] * block_size + x % block_size of the cache.
    A layer's AttentionVariant (vllm/attention/variant.py) changes this as documented
    there, through three constexpr flags and their runtime values:
    - SLIDING_WINDOW (`window`): keys below p - window + 1 are masked. KV tiles wholly
      before every row's window are never loaded, so a long context costs only the window.
    - SOFT_CAP (`soft_cap_log2` = cap * log2 e): the scaled score x becomes
      cap * tanh(x / cap) before masking; the kernels hold scores in the log2 domain
      (x * log2 e), where the same map is C * tanh(s / C) with C = cap * log2 e.
    - HAS_SINKS (`sinks_ptr`, [num_heads] fp32): the running softmax state of each query
      head starts from its sink (max = sink * log2 e, denominator 1, no value), which is
      exactly one more logit in the softmax. Split-K decode seeds only split 0, so the
      reduce counts the sink once.
    With every flag off the kernels compile to the plain attention above.

Invariants:
- Everything is read from the cache: store_kv has already written this step's keys.
- Scores, softmax statistics and the output accumulator are fp32; probabilities are
  cast to the value dtype only as a tl.dot operand.
- The G query heads that share a kv head are packed into the rows of one tile, so each
  K/V tile is loaded once per kv head, not once per query head.
- Head sizes that are not a power of two (or below 16) are padded with masked lanes;
  tile dims are >= 16 so tl.dot lowers to tensor-core instructions on GPU.
- The decode grid and its split count depend only on tensor shapes, never on sequence
  lengths, so the decode path can be captured in a CUDA graph and replayed.
- Block ids are widened to int64 before being scaled to element offsets.
- The running max starts at a large finite negative value (or the sink) instead of -inf
  so a fully masked tile gives p = 0 rather than NaN; a row that saw no key outputs 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.variant import PLAIN, AttentionVariant

_LOG2E = 1.4426950408889634
_NEG_INIT = tl.constexpr(-1.0e30)  # constexprs so the kernels may read them
_LOG2E_K = tl.constexpr(_LOG2E)
_TWO_LOG2E = tl.constexpr(2 * _LOG2E)
# The variant flags of the launch tables (decode_launch, prefill_launch keyword arguments).
VARIANT_FLAGS = ("sliding_window", "soft_cap", "sinks")
MAX_DECODE_SPLITS = 16  # default_num_splits picks a power of two up to this


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, BLOCK_D] queries of this tile
    m_i,  # [BLOCK_M] running max (log2 domain)
    l_i,  # [BLOCK_M] running softmax denominator
    acc,  # [BLOCK_M, BLOCK_D] fp32 running numerator
    k_base,  # key cache pointer, already offset to this kv head
    v_base,  # value cache pointer, already offset to this kv head
    bt_row,  # block-table row of this sequence
    tile_start,  # first KV position of this tile
    kv_end,  # positions >= kv_end are not loaded
    q_pos,  # [BLOCK_M] position of each query row (causal limit)
    block_size,
    head_size,
    stride_c_slot,
    scale_log2,
    window,  # positions a query sees, itself included (SLIDING_WINDOW)
    soft_cap_log2,  # soft cap * log2 e (SOFT_CAP)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over KV positions tile_start .. tile_start + BLOCK_N - 1.

    With MASKED=False the caller guarantees every position is < kv_end and visible to
    every row (causally and within the window), so the score mask is skipped.
    """
    pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    pos_ok = pos < kv_end
    dims = tl.arange(0, BLOCK_D)
    block = tl.load(bt_row + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
    slot = block * block_size + pos % block_size
    kv_off = slot[:, None] * stride_c_slot + dims[None, :]  # [BLOCK_N, BLOCK_D]
    kv_mask = pos_ok[:, None] & (dims[None, :] < head_size)
    k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if SOFT_CAP:
        # C * tanh(s / C) with tanh(|y|) = (1 - e) / (1 + e), e = exp(-2|y|) in (0, 1]: no
        # overflow for any score (libdevice.tanh has no interpreter version).
        e = tl.exp2(tl.abs(s) * (-_TWO_LOG2E / soft_cap_log2))
        t = soft_cap_log2 * (1.0 - e) / (1.0 + e)
        s = tl.where(s >= 0, t, -t)
    if MASKED:
        visible = pos[None, :] <= q_pos[:, None]  # [BLOCK_M, BLOCK_N]
        if SLIDING_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]; decode rows first
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_tokens, num_heads, head_size] (NUM_SPLITS == 1)
    part_acc_ptr,  # [num_decodes, num_heads, NUM_SPLITS, head_size] fp32 (NUM_SPLITS > 1)
    part_ml_ptr,  # [2, num_decodes, num_heads, NUM_SPLITS] fp32: running max, denominator
    sinks_ptr,  # [num_heads] fp32 sink logits (HAS_SINKS)
    scale_log2,
    window,
    soft_cap_log2,
    num_heads,
    group,
    head_size,
    block_size,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    stride_ml,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, split) attends the G query heads of one kv head over a
    contiguous 1/NUM_SPLITS share of the sequence's visible KV tiles."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    if SLIDING_WINDOW:  # the splits share only the tiles from the one holding the window's start
        tile_first = tl.maximum(seq_len - window, 0) // BLOCK_N
    else:
        tile_first = 0
    tiles_per_split = (num_tiles - tile_first + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = tile_first + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g  # [BLOCK_G]
    row_mask = (g[:, None] < group) & (dims[None, :] < head_size)  # [BLOCK_G, BLOCK_D]
    q_row = seq.to(tl.int64) * stride_q_tok
    q = tl.load(q_ptr + q_row + heads[:, None] * stride_q_head + dims[None, :], mask=row_mask, other=0.0)
    q_pos = tl.full([BLOCK_G], 0, dtype=tl.int32) + (seq_len - 1)  # a decode sees every cached key

    m_i = tl.full([BLOCK_G], _NEG_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0, dtype=tl.float32)
    if HAS_SINKS:  # only split 0 holds the sink, so the reduce adds it once
        sink = tl.load(sinks_ptr + heads, mask=g < group, other=0.0) * _LOG2E_K  # [BLOCK_G]
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.full([BLOCK_G, BLOCK_D], 0, dtype=tl.float32)
    head_off = kv_head.to(tl.int64) * stride_c_head
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile in range(tile_lo, tile_hi):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, cache_ptr + head_off, cache_ptr + stride_c_kv + head_off, bt_row,
            tile * BLOCK_N, seq_len, q_pos, block_size, head_size, stride_c_slot, scale_log2,
            window, soft_cap_log2, BLOCK_N, BLOCK_D, True, SLIDING_WINDOW, SOFT_CAP, DOT_PRECISION,
        )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = seq.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        ml_off = (seq * num_heads + heads).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_ml_ptr + ml_off, m_i, mask=g < group)
        tl.store(part_ml_ptr + stride_ml + ml_off, l_i, mask=g < group)
        tl.store(part_acc_ptr + ml_off[:, None] * head_size + dims[None, :], acc, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    part_acc_ptr,  # [num_decodes, num_heads, NUM_SPLITS, head_size] fp32
    part_ml_ptr,  # [2, num_decodes, num_heads, NUM_SPLITS] fp32
    num_heads,
    head_size,
    stride_o_tok,
    stride_o_head,
    stride_ml,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Program (seq, head) merges the per-split softmax states into the output row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    base = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + splits  # [NUM_SPLITS]
    m = tl.load(part_ml_ptr + base)
    l = tl.load(part_ml_ptr + stride_ml + base)
    acc = tl.load(part_acc_ptr + base[:, None] * head_size + dims[None, :], mask=dims[None, :] < head_size, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # empty splits have m = _NEG_INIT and l = 0
    denom = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    o_off = seq.to(tl.int64) * stride_o_tok + head * stride_o_head + dims
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=dims < head_size)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_size]
    sinks_ptr,  # [num_heads] fp32 sink logits (HAS_SINKS)
    first_seq,
    scale_log2,
    window,
    soft_cap_log2,
    group,
    head_size,
    block_size,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, query tile, kv_head) attends BLOCK_Q query tokens x the G heads of
    one kv head (BLOCK_Q * BLOCK_G rows) over the cached prefix and the new tokens."""
    seq = first_seq + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    rows = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + rows // BLOCK_G  # [BLOCK_M] query index within the sequence
    g = rows % BLOCK_G
    dims = tl.arange(0, BLOCK_D)
    mask = ((qi < q_len) & (g < group))[:, None] & (dims[None, :] < head_size)  # [BLOCK_M, BLOCK_D]
    tok = (q_start + qi).to(tl.int64)
    heads = kv_head * group + g
    q_off = tok[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)
    q_pos = context + qi

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=g < group, other=0.0) * _LOG2E_K  # [BLOCK_M]
        l_i = tl.full([BLOCK_M], 1, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], _NEG_INIT, dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0, dtype=tl.float32)
    head_off = kv_head.to(tl.int64) * stride_c_head
    k_base = cache_ptr + head_off
    v_base = cache_ptr + stride_c_kv + head_off
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    # Positions below the tile's first query position are causally visible to every row.
    first_q_pos = context + q_tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)  # kv_end - 1: the last row's position
    full_end = (first_q_pos // BLOCK_N) * BLOCK_N
    if SLIDING_WINDOW:
        # Tiles before the first row's window are skipped; those before the last row's
        # window start need the window mask; the rest up to full_end is visible to all.
        win_lo = (tl.maximum(first_q_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        unmasked_lo = tl.minimum((tl.maximum(kv_end - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, full_end)
        for start in range(win_lo, unmasked_lo, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_base, v_base, bt_row, start, kv_end, q_pos, block_size, head_size,
                stride_c_slot, scale_log2, window, soft_cap_log2, BLOCK_N, BLOCK_D, True, True, SOFT_CAP,
                DOT_PRECISION,
            )
    else:
        unmasked_lo = 0
    for start in range(unmasked_lo, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, bt_row, start, kv_end, q_pos, block_size, head_size,
            stride_c_slot, scale_log2, window, soft_cap_log2, BLOCK_N, BLOCK_D, False, SLIDING_WINDOW, SOFT_CAP,
            DOT_PRECISION,
        )
    for start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, bt_row, start, kv_end, q_pos, block_size, head_size,
            stride_c_slot, scale_log2, window, soft_cap_log2, BLOCK_N, BLOCK_D, True, SLIDING_WINDOW, SOFT_CAP,
            DOT_PRECISION,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = tok[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tests must not silently run in tf32 on GPU; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _common_args(query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor) -> tuple:
    if query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged attention needs query and out contiguous in their last dimension.")
    return (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3))


def _variant_constexprs(sliding_window: bool, soft_cap: bool, sinks: bool) -> dict:
    return dict(SLIDING_WINDOW=sliding_window, SOFT_CAP=soft_cap, HAS_SINKS=sinks)


def variant_flags(variant: AttentionVariant) -> dict:
    """The keyword arguments (VARIANT_FLAGS) of decode_launch / prefill_launch for a variant."""
    return dict(sliding_window=variant.sliding_window is not None, soft_cap=variant.soft_cap is not None,
                sinks=variant.sinks is not None)


def _variant_args(variant: AttentionVariant, num_heads: int, device: torch.device) -> tuple:
    """(window, soft_cap_log2, sinks) runtime arguments of the kernels. Unused ones get
    harmless values; the sinks become [num_heads] fp32 on the query's device (no copy when
    they already are)."""
    window = variant.sliding_window if variant.sliding_window is not None else 0
    soft_cap_log2 = variant.soft_cap * _LOG2E if variant.soft_cap is not None else 1.0
    if variant.sinks is None:  # never read; empty launches no fill kernel on the plain path
        sinks = torch.empty(1, dtype=torch.float32, device=device)
    elif variant.sinks.shape != (num_heads,):
        raise ValueError(f"attention sinks must hold one logit per query head, shape ({num_heads},); "
                         f"got shape {tuple(variant.sinks.shape)}.")
    else:
        sinks = variant.sinks.to(device=device, dtype=torch.float32).contiguous()
    return window, soft_cap_log2, sinks


def default_num_splits(num_decodes: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits of the KV range so that decode fills the GPU (about two waves of programs).

    Depends only on batch shape, so a captured CUDA graph stays valid for any lengths.
    """
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = triton.cdiv(target, max(1, num_decodes * num_kv_heads))
    return min(MAX_DECODE_SPLITS, triton.next_power_of_2(splits))


def decode_launch(head_size: int, group: int, num_splits: int, dtype: torch.dtype,
                  sliding_window: bool = False, soft_cap: bool = False, sinks: bool = False) -> dict:
    """Constexprs and launch options of _decode_kernel: the one table paged_decode and
    benchmarks/triton_aot.py both use, so the AOT check compiles what is launched. The
    flags say which parts of the layer's AttentionVariant are compiled in.

    BLOCK_N=32 with 8 warps: every K/V element carries its own 64-bit address, and the
    former 64-key tiles on 4 warps needed over 255 registers per thread and spilled on
    sm_80 and sm_90 at head size 128 (found by benchmarks/triton_aot.py)."""
    block_d = max(16, triton.next_power_of_2(head_size))
    return dict(
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(dtype),
        **_variant_constexprs(sliding_window, soft_cap, sinks),
        num_warps=8,
        num_stages=2,
    )


def decode_reduce_launch(head_size: int, num_splits: int) -> dict:
    """Constexprs and launch options of _decode_reduce_kernel (only run when num_splits > 1)."""
    return dict(BLOCK_D=max(16, triton.next_power_of_2(head_size)), NUM_SPLITS=num_splits, num_warps=4)


def prefill_launch(head_size: int, group: int, dtype: torch.dtype, block_m: int | None = None,
                   sliding_window: bool = False, soft_cap: bool = False, sinks: bool = False) -> dict:
    """Constexprs and launch options of _prefill_kernel (BLOCK_Q query tokens x BLOCK_G heads
    = about block_m rows per program); BLOCK_N, num_warps and the variant flags as in
    decode_launch, for the same reasons (spills at 64-key tiles on 4 warps).

    block_m defaults to 64 rows up to head size 128 and 32 above: a program holds its rows'
    queries and fp32 accumulators in registers, and 64 rows of 256 dimensions (Gemma) spilled
    8-296 bytes on sm_80 and sm_90 in bf16/fp16 (found by benchmarks/triton_aot.py)."""
    block_g = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_size))
    if block_m is None:
        block_m = 64 if block_d <= 128 else 32
    return dict(
        BLOCK_Q=max(1, block_m // block_g),
        BLOCK_G=block_g,
        BLOCK_N=32,
        BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(dtype),
        **_variant_constexprs(sliding_window, soft_cap, sinks),
        num_warps=8,
        num_stages=2,
    )


def paged_decode(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], rows 0:num_decodes written
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    num_decodes: int,
    scale: float,
    num_splits: int | None = None,
    variant: AttentionVariant = PLAIN,
) -> None:
    """Attention of the first num_decodes sequences (one query token each, rows 0:num_decodes)."""
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(num_decodes, num_kv_heads, query.device)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}.")
    if num_splits > 1:
        part_acc = torch.empty(num_decodes, num_heads, num_splits, head_size, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(2, num_decodes, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:  # unused by the kernel; any fp32 tensor keeps the signature uniform
        part_acc = part_ml = torch.empty(2, 1, dtype=torch.float32, device=query.device)
    strides = _common_args(query, out, kv_cache)
    window, soft_cap_log2, sinks = _variant_args(variant, num_heads, query.device)
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, kv_cache, block_table, seq_lens, out, part_acc, part_ml, sinks,
        scale * _LOG2E, window, soft_cap_log2, num_heads, group, head_size, block_size,
        *strides, block_table.stride(0), part_ml.stride(0),
        **decode_launch(head_size, group, num_splits, query.dtype, **variant_flags(variant)),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            out, part_acc, part_ml, num_heads, head_size, out.stride(0), out.stride(1), part_ml.stride(0),
            **decode_reduce_launch(head_size, num_splits),
        )


def paged_prefill(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size]; rows of sequences first_seq: written
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    first_seq: int,
    num_prefills: int,
    max_query_len: int,
    scale: float,
    block_m: int | None = None,
    variant: AttentionVariant = PLAIN,
) -> None:
    """Causal attention of sequences first_seq .. first_seq + num_prefills - 1 over their
    cached prefix plus their new tokens."""
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    launch = prefill_launch(head_size, group, query.dtype, block_m, **variant_flags(variant))
    strides = _common_args(query, out, kv_cache)
    window, soft_cap_log2, sinks = _variant_args(variant, num_heads, query.device)
    grid = (num_prefills, triton.cdiv(max_query_len, launch["BLOCK_Q"]), num_kv_heads)
    _prefill_kernel[grid](
        query, kv_cache, block_table, seq_lens, query_start_loc, out, sinks,
        first_seq, scale * _LOG2E, window, soft_cap_log2, group, head_size, block_size,
        *strides, block_table.stride(0),
        **launch,
    )
