"""The CPU's native multi-LoRA op (vllm/csrc/cpu/lora_runs.cpp) for a layer's stacked slots.

`add_lora_runs` computes what `torch_ops.add_lora` computes for a step whose adapted tokens
form runs (`LoRAKernelMeta.runs`), up to summation order, in one native call per layer instead
of two small torch matmuls per run (whose dispatch, not arithmetic, is their cost on the CPU).
It reads B transposed (`b_t` [max_loras, rank width, out]: on the CPU vllm/lora/layers.py stores
B so, the torch path reading its transposed view) and only each slice's own block of it (`blocks`: the zero blocks of
the block-diagonal stacked B add nothing). Its dot products run one token at a time, so it wins
where few tokens are adapted (decodes, short aLoRA invocations: NATIVE_MAX_TOKENS); steps with
more, with gathered groups (a fragmented mapping), other dtypes, or under
VLLM_USE_TORCH_REFERENCE_OPS take the torch path (`runs_native`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from vllm import envs, native_build
from vllm.lora.punica import LoRAKernelMeta

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
# Adapted tokens of a step up to which the native op runs, per dtype. One Zen 4 thread, SmolLM2's 120
# LoRA layers (rank 16), the op's time against the torch op's: bf16 1 / 4 / 8 / 16 / 32 tokens 0.2 /
# 0.38 / 0.57-0.66 / 0.89 / 1.25x; fp32 1 / 4 / 8 / 16 tokens 0.44 / 0.50 / 0.68 / 0.84x, but in the
# engine an fp32 aLoRA step of 16 adapted tokens took 1.03-1.20x the torch op's time.
NATIVE_MAX_TOKENS = {torch.bfloat16: 16, torch.float32: 8}


def unavailable_reason() -> Optional[str]:
    """Builds (first time on this machine) or loads the kernel. None on success, else why not."""
    return native_build.unavailable_reason("lora_runs.cpp", "CPU LoRA kernel")


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer on `device` with slots of `dtype` may keep B transposed for this op."""
    return (device.type == "cpu" and dtype in NATIVE_DTYPES and not envs.VLLM_USE_TORCH_REFERENCE_OPS
            and unavailable_reason() is None)


def runs_native(meta: LoRAKernelMeta, dtype: torch.dtype) -> bool:
    """This step's mapping as runs the op takes (no gather groups, no graph step), few enough tokens."""
    return (bool(meta.runs) and not meta.groups and not meta.graph
            and meta.run_tokens <= NATIVE_MAX_TOKENS.get(dtype, 0))


def add_lora_runs(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, blocks: Sequence[int],
                  meta: LoRAKernelMeta) -> None:
    """y [T, out] += each run's (x @ a[slot].T) @ b_t[slot] within `blocks` (flat column start,
    column count, rank start, rank count per slice); semantics: lora_runs.cpp's header."""
    torch.ops.vllm_lora.add_lora_runs(y, x, a, b_t, blocks, meta.flat_runs)
