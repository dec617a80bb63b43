"""Native CPU attention: every sequence (decodes, an aLoRA's few tokens over a long cached
conversation, prompts and chunks of any length: MAX_QUERY_LEN) runs the C++ kernel of
vllm/csrc/cpu/paged_attention.cpp, which reads keys and values in place from the paged KV
cache; sequences above MAX_QUERY_LEN would run the torch reference. Same signature and
semantics as vllm/attention/backends/torch_ref.py, which stays the reference and the test
oracle, every AttentionVariant included: the kernel applies the sliding window (reading only
the blocks the window touches), the logit soft cap and the sinks itself.

Why: torch_ref gathers every block it reads into a contiguous copy and builds a mask
before SDPA; with few query rows over a long context that copy and mask cost more than
the attention itself. The kernel skips both, and for prompts its register-tiled loops over
transposed key chunks run at 2-3x SDPA's rate where vectors are 512 bits wide, 0.95-1.8x with AVX2.

Invariants:
  - The kernel is built on first use (the first Attention layer of an engine on CPU, never
    at `import vllm`) for this CPU and cached, by vllm/native_build.py (a generic
    -march-less build measured 1.6x slower than the torch reference, so none is made).
  - The build is tried at most once per process. Any failure logs one warning,
    `is_available()` stays False and `unavailable_reason()` says why; the engine then runs
    torch_ref. The engine works without the kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from vllm import native_build
from vllm.attention.backends import torch_ref
from vllm.attention.metadata import AttentionMetadata
from vllm.attention.variant import PLAIN, AttentionVariant


def unavailable_reason() -> Optional[str]:
    """Builds (first time on this machine) or loads the kernel (vllm/native_build.py). None on
    success, else the first line of the error, which is also logged once as a warning."""
    return native_build.unavailable_reason("paged_attention.cpp", "CPU attention kernel")


def is_available() -> bool:
    return unavailable_reason() is None


def rotary_kv_unavailable_reason() -> Optional[str]:
    """Builds or loads vllm/csrc/cpu/rotary_kv.cpp (rotary embedding and the KV store, the two
    small ops around attention; rotary.py calls its `rotary`). None on success, else why not."""
    return native_build.unavailable_reason("rotary_kv.cpp", "CPU rotary and KV-store kernels")


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """torch_ref.store_kv in one native call: no host sync to skip padding slots, no index
    copies. Used where rotary_kv_unavailable_reason() is None (vllm/attention/layer.py picks it
    once, while the model is built); a layout the kernel does not take falls back to torch_ref."""
    if (key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2] and slot_mapping.dtype == torch.int64
            and kv_cache.is_contiguous()):
        torch.ops.vllm_rotary_kv.store_kv(kv_cache, key, value, slot_mapping.contiguous())
    else:
        torch_ref.store_kv(key, value, kv_cache, slot_mapping)


# Query tokens up to which a sequence runs the kernel rather than SDPA: every length, on every
# CPU. Measured one thread, 9 query / 3 KV heads of 64 (benchmarks/cpu_attention.py): on an
# AVX-512 EPYC (Zen 5 class) the kernel takes 0.31x torch_ref's time for a 512-token prompt,
# 0.43x at 2,048, 0.51x at 8,192 (165 GFLOP/s, flat from 2k to 16k: time stays proportional to
# FLOPs), 0.34-0.42x for 512-2,048 new tokens over a 2k-4k cached prefix. On an AVX2 Zen 3 EPYC,
# with 6-row register tiles and the keys transposed in 8 x 8 register tiles (at::vec's transpose
# is scalar there), 0.55x at 512, 0.8x at 2,048 and for 512 new tokens over a 2k prefix, 0.95x at
# 4,096 and 1.06x at 8,192 (the kernel flat at 55-65 GFLOP/s, SDPA's GEMMs reaching 60 at 8k); on
# two threads 0.78-0.88x from 2,048 to 8,192 (a prompt's groups are taken costliest first). A
# prefill's partial results are one group's at a time per thread (tens of KB), whatever the
# prompt's length.
MAX_QUERY_LEN = 2**31 - 1


def paged_attention_rows(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                         variant: AttentionVariant = PLAIN) -> None:
    """out rows of every sequence with at most `max_query_len` query tokens (others are not
    written): sequence i's tokens query_start_loc[i]:query_start_loc[i+1] are its newest, on
    top of seq_lens[i] - their count cached positions, attending causally as `variant` says.
    out, query: [num_tokens, H, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; block_table:
    [>= num_seqs, max_blocks], seq_lens: [num_seqs], query_start_loc: [num_seqs + 1], all int32.
    Call is_available() first."""
    # The op spells "none" as 0, 0.0 and no tensor; the variant has already refused windows < 1
    # and caps <= 0, so an unset field never collides with a set one.
    torch.ops.vllm_cpu.paged_attention(out, query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
                                       scale, variant.sliding_window or 0, variant.soft_cap or 0.0, variant.sinks)


def _short_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, variant: AttentionVariant) -> int:
    paged_attention_rows(out, query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc, MAX_QUERY_LEN,
                         scale, variant)
    return MAX_QUERY_LEN


# torch_ref's paged attention with the short sequences on the native kernel.
paged_attention = functools.partial(torch_ref.paged_attention, short=_short_attention)
