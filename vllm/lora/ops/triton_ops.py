"""Triton multi-LoRA op (the CUDA path), same signature and semantics as
vllm/lora/ops/torch_ops.add_lora.

Semantics:
    for every token t with slot s = token_lora_mapping[t] >= 0, and every slice i:
        h = x[t] @ lora_a[i][s].T                                  (shrink, fp32 accumulate)
        y[t, off_i : off_i + n_i] += h @ lora_b[i][s].T            (expand, fp32 accumulate)
    rows with slot -1 are never read or written, so they stay bit-for-bit unchanged.
    h is rounded to lora_b's dtype before the expand, as the torch reference does.

Two kernel pairs, one launch of shrink and one of expand per slice:
- SGMV (prefill-sized batches): tokens grouped by adapter (meta.sorted_token_ids /
  seg_*); a program handles BLOCK_M tokens of one segment with tl.dot, so each adapter
  weight tile is read once per BLOCK_M tokens. -1 tokens belong to no segment: no cost.
- BGMV (decode-sized batches, and always under CUDA-graph capture): one program per
  token row, reading its slot from the persistent meta.token_lora_mapping; -1 rows exit
  at once. Its grid depends only on the number of rows, never on the mapping's values,
  so a captured graph stays valid when the mapping buffer is refilled.

Invariants: h is an fp32 scratch buffer ([rows, max_rank] per slice, zero-filled when
the shrink splits K and accumulates with atomics); slot indices are widened to int64
before being scaled by weight strides; rank is padded to >= 16 with masked lanes so
tl.dot shapes are legal on GPU.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from vllm.lora.punica import LoRAKernelMeta

# Above this many tokens, grouping by adapter (SGMV) beats per-row BGMV.
BGMV_MAX_TOKENS = 64
MAX_SPLIT_K = 16  # _split_k picks a power of two up to this


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [max_loras, max_rank, in_features]
    h_ptr,  # [num_adapted_tokens, max_rank] fp32, indexed by sorted position
    sorted_ids_ptr,  # [num_adapted_tokens] int64
    seg_slots_ptr,  # [num_segments] int32
    seg_starts_ptr,  # [num_segments] int32
    seg_lens_ptr,  # [num_segments] int32
    in_features,
    rank,
    stride_x_tok,
    stride_x_k,
    stride_a_slot,
    stride_a_rank,
    stride_a_k,
    stride_h_row,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (segment, token tile, k split): h[rows] (+)= x[tokens, k-range] @ A[slot, :, k-range].T"""
    seg = tl.program_id(0)
    m_tile = tl.program_id(1)
    k_split = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if m_tile * BLOCK_M >= seg_len:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < seg_len
    rows = tl.load(seg_starts_ptr + seg) + m  # [BLOCK_M] positions in sorted order
    tok = tl.load(sorted_ids_ptr + rows, mask=m_mask, other=0)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    x_rows = x_ptr + tok[:, None] * stride_x_tok  # [BLOCK_M, 1]
    a_rows = a_ptr + slot * stride_a_slot + r[:, None] * stride_a_rank  # [BLOCK_R, 1]
    acc = tl.full([BLOCK_M, BLOCK_R], 0, dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, in_features, BLOCK_K * SPLIT_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xt = tl.load(x_rows + k[None, :] * stride_x_k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + k[None, :] * stride_a_k, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(at), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_R]
    h_off = rows[:, None].to(tl.int64) * stride_h_row + r[None, :]
    h_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptr + h_off, acc, mask=h_mask)
    else:
        tl.atomic_add(h_ptr + h_off, acc, mask=h_mask)


@triton.jit
def _sgmv_expand_kernel(
    h_ptr,  # [num_adapted_tokens, max_rank] fp32
    b_ptr,  # [max_loras, n_out, max_rank]
    y_ptr,  # [num_tokens, total_out]
    sorted_ids_ptr,
    seg_slots_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    n_out,
    rank,
    col_offset,
    stride_h_row,
    stride_b_slot,
    stride_b_n,
    stride_b_rank,
    stride_y_tok,
    stride_y_col,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (segment, token tile, column tile): y[tokens, cols] += h[rows] @ B[slot, cols, :].T"""
    seg = tl.program_id(0)
    m_tile = tl.program_id(1)
    n_tile = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if m_tile * BLOCK_M >= seg_len:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < seg_len
    rows = tl.load(seg_starts_ptr + seg) + m
    tok = tl.load(sorted_ids_ptr + rows, mask=m_mask, other=0)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < n_out
    b = tl.load(
        b_ptr + slot * stride_b_slot + n[:, None] * stride_b_n + r[None, :] * stride_b_rank,
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_R]
    h_off = rows[:, None].to(tl.int64) * stride_h_row + r[None, :]
    h = tl.load(h_ptr + h_off, mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    delta = tl.dot(h.to(b.dtype), tl.trans(b), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    y_off = tok[:, None] * stride_y_tok + (col_offset + n)[None, :] * stride_y_col
    y_mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptr + y_off, mask=y_mask)
    tl.store(y_ptr + y_off, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [max_loras, max_rank, in_features]
    h_ptr,  # [num_rows, max_rank] fp32
    mapping_ptr,  # [num_rows] int32, -1 = no adapter
    in_features,
    rank,
    stride_x_tok,
    stride_x_k,
    stride_a_slot,
    stride_a_rank,
    stride_a_k,
    stride_h_row,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program (row, k split): h[row] (+)= A[slot, :, k-range] @ x[row, k-range]."""
    row = tl.program_id(0).to(tl.int64)
    k_split = tl.program_id(1)
    slot = tl.load(mapping_ptr + row)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + r[:, None] * stride_a_rank  # [BLOCK_R, 1]
    # Accumulate elementwise products and reduce once at the end: fewer reductions.
    acc = tl.full([BLOCK_R, BLOCK_K], 0, dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, in_features, BLOCK_K * SPLIT_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xv = tl.load(x_ptr + row * stride_x_tok + k * stride_x_k, mask=k_mask, other=0.0)  # [BLOCK_K]
        at = tl.load(a_rows + k[None, :] * stride_a_k, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += at.to(tl.float32) * xv.to(tl.float32)[None, :]
    h = tl.sum(acc, axis=1)  # [BLOCK_R]
    if SPLIT_K == 1:
        tl.store(h_ptr + row * stride_h_row + r, h, mask=r_mask)
    else:
        tl.atomic_add(h_ptr + row * stride_h_row + r, h, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(
    h_ptr,  # [num_rows, max_rank] fp32
    b_ptr,  # [max_loras, n_out, max_rank]
    y_ptr,  # [num_tokens, total_out]
    mapping_ptr,  # [num_rows] int32
    n_out,
    rank,
    col_offset,
    stride_h_row,
    stride_b_slot,
    stride_b_n,
    stride_b_rank,
    stride_y_tok,
    stride_y_col,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (row, column tile): y[row, cols] += B[slot, cols, :] @ h[row]."""
    row = tl.program_id(0).to(tl.int64)
    n_tile = tl.program_id(1)
    slot = tl.load(mapping_ptr + row)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < n_out
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_b_slot + n[:, None] * stride_b_n + r[None, :] * stride_b_rank,
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_R]
    h = tl.load(h_ptr + row * stride_h_row + r, mask=r_mask, other=0.0)
    h = h.to(b.dtype).to(tl.float32)  # same rounding as the SGMV path's dot operand
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)  # [BLOCK_N]
    y_off = row * stride_y_tok + (col_offset + n) * stride_y_col
    y = tl.load(y_ptr + y_off, mask=n_mask)
    tl.store(y_ptr + y_off, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 must not silently run in tf32 on GPU; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _split_k(num_programs: int, in_features: int, block_k: int, device: torch.device) -> int:
    """Split the shrink's reduction when too few programs would leave SMs idle."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    split = triton.next_power_of_2(triton.cdiv(target, max(1, num_programs)))
    return max(1, min(split, MAX_SPLIT_K, triton.cdiv(in_features, block_k)))


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def sgmv_shrink_launch(rank: int, split_k: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of _sgmv_shrink_kernel. This and the three below are
    the one table the launchers and benchmarks/triton_aot.py both use."""
    return dict(BLOCK_M=32, BLOCK_R=_block_r(rank), BLOCK_K=64, SPLIT_K=split_k,
                DOT_PRECISION=_dot_precision(dtype), num_warps=4)


def sgmv_expand_launch(rank: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of _sgmv_expand_kernel (BLOCK_M must match the shrink's)."""
    return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_R=_block_r(rank), DOT_PRECISION=_dot_precision(dtype), num_warps=4)


def bgmv_shrink_launch(rank: int, split_k: int) -> dict:
    """Constexprs and launch options of _bgmv_shrink_kernel."""
    block_r = _block_r(rank)
    block_k = max(32, min(256, 4096 // block_r))  # ~4K fp32 accumulators per program
    return dict(BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4)


def bgmv_expand_launch(rank: int) -> dict:
    """Constexprs and launch options of _bgmv_expand_kernel."""
    return dict(BLOCK_N=64, BLOCK_R=_block_r(rank), num_warps=4)


def use_sgmv(meta: LoRAKernelMeta, x: torch.Tensor) -> bool:
    """SGMV for large batches; BGMV for small ones and whenever a CUDA graph is being
    captured (segment tensors change shape from step to step, the mapping buffer does not)."""
    if meta.sorted_token_ids is None or meta.num_tokens <= BGMV_MAX_TOKENS:
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _sgmv(y, x, a, b, col_offset, meta, split_k):
    num_segments = meta.seg_slots.shape[0]
    rank, in_features = a.shape[1], a.shape[2]
    n_out = b.shape[1]
    expand = sgmv_expand_launch(rank, b.dtype)
    block_m = expand["BLOCK_M"]
    num_rows = meta.sorted_token_ids.shape[0]
    m_tiles = triton.cdiv(meta.max_seg_len, block_m)
    if split_k is None:
        split_k = _split_k(num_segments * m_tiles, in_features, sgmv_shrink_launch(rank, 1, x.dtype)["BLOCK_K"], x.device)
    shrink = sgmv_shrink_launch(rank, split_k, x.dtype)
    alloc = torch.zeros if split_k > 1 else torch.empty
    h = alloc(num_rows, rank, dtype=torch.float32, device=x.device)
    seg = (meta.sorted_token_ids, meta.seg_slots, meta.seg_starts, meta.seg_lens)
    _sgmv_shrink_kernel[(num_segments, m_tiles, split_k)](
        x, a, h, *seg, in_features, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
        **shrink,
    )
    _sgmv_expand_kernel[(num_segments, m_tiles, triton.cdiv(n_out, expand["BLOCK_N"]))](
        h, b, y, *seg, n_out, rank, col_offset,
        h.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        **expand,
    )


def _bgmv(y, x, a, b, col_offset, meta, split_k):
    mapping = meta.token_lora_mapping
    num_rows = mapping.shape[0]
    rank, in_features = a.shape[1], a.shape[2]
    n_out = b.shape[1]
    if split_k is None:
        split_k = _split_k(num_rows, in_features, bgmv_shrink_launch(rank, 1)["BLOCK_K"], x.device)
    expand = bgmv_expand_launch(rank)
    alloc = torch.zeros if split_k > 1 else torch.empty
    h = alloc(num_rows, rank, dtype=torch.float32, device=x.device)
    _bgmv_shrink_kernel[(num_rows, split_k)](
        x, a, h, mapping, in_features, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
        **bgmv_shrink_launch(rank, split_k),
    )
    _bgmv_expand_kernel[(num_rows, triton.cdiv(n_out, expand["BLOCK_N"]))](
        h, b, y, mapping, n_out, rank, col_offset,
        h.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        **expand,
    )


def add_lora(
    y: torch.Tensor,  # [num_tokens, sum(output_slices)], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: Sequence[torch.Tensor],  # per slice [max_loras, max_rank, in_features]
    lora_b: Sequence[torch.Tensor],  # per slice [max_loras, n_i, max_rank]
    output_slices: Sequence[int],
    meta: LoRAKernelMeta,
    *,
    sgmv: bool | None = None,
    split_k: int | None = None,
) -> None:
    """`sgmv` / `split_k` override the automatic choices (tests use them to cover every path)."""
    if meta.token_lora_mapping is None or meta.num_tokens == 0:
        return
    if sgmv is None:
        sgmv = use_sgmv(meta, x)
    if sgmv and meta.sorted_token_ids is None:
        return  # no token uses an adapter
    run = _sgmv if sgmv else _bgmv
    col_offset = 0
    for a, b, n_out in zip(lora_a, lora_b, output_slices):
        if b.shape[1] != n_out or a.shape[1] != b.shape[2]:
            raise ValueError(
                f"LoRA slice shapes {tuple(a.shape)} / {tuple(b.shape)} do not match output slice {n_out}."
            )
        run(y, x, a, b, col_offset, meta, split_k)
        col_offset += n_out
