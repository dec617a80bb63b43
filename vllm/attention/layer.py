"""`Attention`: the model-facing attention layer. It stores this step's keys and
values into the layer's paged KV cache, then attends over the cache.

The implementation is picked once per device (vllm.platforms): Triton kernels on CUDA,
the native C++ kernel on CPU when it builds (decodes and short prefills; long prefills
stay on the torch reference), the torch reference everywhere else.
Models never see the choice.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.attention.backends import torch_ref
from vllm.attention.metadata import AttentionMetadata
from vllm.attention.variant import PLAIN, AttentionVariant
from vllm.platforms import use_native_cpu_attention, use_triton_kernels


def _select_ops(device: torch.device):
    if use_triton_kernels(device):
        from vllm.attention.backends import triton_backend

        return triton_backend.store_kv, triton_backend.paged_attention
    if use_native_cpu_attention(device):
        from vllm.attention.backends import cpu_native

        store_kv = cpu_native.store_kv if cpu_native.rotary_kv_unavailable_reason() is None else torch_ref.store_kv
        return store_kv, cpu_native.paged_attention
    return torch_ref.store_kv, torch_ref.paged_attention


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, device: torch.device,
                 variant: AttentionVariant = PLAIN):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.variant = variant
        self._store_kv, self._attend = _select_ops(device)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        n = meta.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        self._store_kv(k, v, kv_cache, meta.slot_mapping[:n])
        out = self._attend(q, k, v, kv_cache, meta, self.scale, self.variant)
        if n == query.shape[0]:
            return out.view(n, -1)
        # CUDA-graph padding rows: keep the buffer shape, leave pad rows at zero.
        full = torch.zeros_like(query)
        full[:n] = out.view(n, -1)
        return full
