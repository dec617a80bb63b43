"""The experts op on CUDA: one Triton grouped matmul over (token, expert) pairs grouped by
expert, used for both projections (`fused_experts_triton`, same contract as
`fused_moe.fused_experts_torch`, which is its oracle).

Layout (as vLLM's `moe_align_block_size`): pairs are sorted by expert and each expert's
run is padded to a multiple of BLOCK_M, so every row block of the grouped matmul
belongs to exactly one expert (`block_expert[b]`). `rows[s]` is the input row that
padded slot `s` reads (-1 for padding: loads masked to zero, stores skipped). The first
matmul reads token rows of x into slots; the second reads the slots themselves. The
expert weights are read once per row block they serve, never per token.

Invariants: fp32 inputs multiply in IEEE fp32 (no TF32), so the CPU interpreter test and
the GPU agree with the torch path within float rounding; the routing weights and the
per-token sum stay in torch (a weighted `index_add_`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.fused_moe import SILU, ExpertActivation

BLOCK_M = 16  # pairs per row block (tl.dot needs >= 16)


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,  # [num_rows, K]
    b_ptr,  # [num_experts, N, K]
    c_ptr,  # [num_slots, N]
    rows_ptr,  # [num_slots] input row per slot, -1 for padding
    block_expert_ptr,  # [num_slots // BLOCK_M]
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rows = tl.load(rows_ptr + slots)
    valid = rows >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    c = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def grouped_matmul_launch(n: int, k: int, dtype: torch.dtype) -> dict:
    """Constexprs of _grouped_matmul_kernel for an [N, K] expert weight: the one table
    _grouped_matmul and benchmarks/triton_aot.py both use (default warps and stages)."""
    return dict(
        BLOCK_M=BLOCK_M,
        BLOCK_N=max(16, min(64, triton.next_power_of_2(n))),
        BLOCK_K=max(16, min(64, triton.next_power_of_2(k))),
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def _grouped_matmul(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor) -> torch.Tensor:
    """c[s] = w[block_expert[s // BLOCK_M]] @ a[rows[s]] for every slot with rows[s] >= 0."""
    n, k = w.shape[1], w.shape[2]
    c = a.new_zeros(rows.shape[0], n)  # padding slots stay zero
    launch = grouped_matmul_launch(n, k, a.dtype)
    grid = (block_expert.shape[0], triton.cdiv(n, launch["BLOCK_N"]))
    _grouped_matmul_kernel[grid](
        a, w, c, rows, block_expert, n, k, a.stride(0), w.stride(0), w.stride(1), c.stride(0), **launch,
    )
    return c


def align_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, slot, block_expert): pair indices sorted by expert, the padded slot of each
    sorted pair, and the expert of each BLOCK_M row block. All on device, no host sync
    but the total padded size."""
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [num_experts]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = counts.cumsum(0) - counts
    padded_starts = padded.cumsum(0) - padded
    sorted_experts = flat_ids[order]
    rank = torch.arange(order.shape[0], device=order.device) - starts[sorted_experts]
    slot = padded_starts[sorted_experts] + rank  # [num_pairs]
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=order.device), padded // BLOCK_M)
    return order, slot, block_expert


def fused_experts_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    w13_bias: Optional[torch.Tensor] = None,  # [num_experts, 2 * intermediate]
    w2_bias: Optional[torch.Tensor] = None,  # [num_experts, hidden]
    activation: ExpertActivation = SILU,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Biases and the activation are applied in torch between the kernel launches: a bias
    is added to every slot of an expert's run (padding slots too, which are never read)."""
    top_k = topk_ids.shape[1]
    order, slot, block_expert = align_pairs(topk_ids, w13.shape[0])
    num_slots = block_expert.shape[0] * BLOCK_M
    token_of = order // top_k  # [num_pairs]
    rows = torch.full((num_slots,), -1, dtype=torch.int32, device=x.device)
    rows[slot] = token_of.to(torch.int32)
    gate_up = _grouped_matmul(x.contiguous(), w13.contiguous(), rows, block_expert)  # [num_slots, 2 * inter]
    # The expert of every padded slot, for the biases: [num_slots]
    slot_expert = block_expert.repeat_interleave(BLOCK_M) if w13_bias is not None or w2_bias is not None else None
    if w13_bias is not None:
        gate_up.add_(w13_bias.index_select(0, slot_expert))
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = activation(gate, up)  # [num_slots, inter]
    rows[slot] = slot.to(torch.int32)  # the second matmul reads each slot's own row
    down = _grouped_matmul(hidden, w2.contiguous(), rows, block_expert)  # [num_slots, hidden]
    if w2_bias is not None:
        down.add_(w2_bias.index_select(0, slot_expert))
    out = down[slot] * topk_weights.reshape(-1)[order].unsqueeze(1).to(down.dtype)  # [num_pairs, hidden]
    return torch.zeros_like(x).index_add_(0, token_of, out)
