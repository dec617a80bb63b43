"""`LinearWithLoRA`: a base linear layer plus stacked adapter weights in `max_loras` slots.

Per fused slice i (q/k/v, or gate/up, or the single slice of o/down):
    lora_a[i]: [max_loras, max_rank, input_size]
    lora_b[i]: [max_loras, output_sizes[i], max_rank]   (PEFT scaling folded in)
A slot holds zeros wherever its adapter has no weights (untargeted slice, rank
below max_rank), so the op needs no per-slot shape logic.

The layer knows nothing of requests or aLoRA: the shared punica wrapper says which
slot each token uses, and -1 tokens keep exactly the base output.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.lora.lora_model import LoRALayerWeights
from vllm.lora.punica import PunicaWrapper


class LinearWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module, max_loras: int, max_rank: int, punica: PunicaWrapper):
        super().__init__()
        self.base_layer = base_layer
        self.punica = punica
        weight = base_layer.weight
        self.input_size = base_layer.input_size
        self.output_sizes = tuple(base_layer.output_sizes)
        self.lora_a = [
            torch.zeros(max_loras, max_rank, self.input_size, dtype=weight.dtype, device=weight.device)
            for _ in self.output_sizes
        ]
        self.lora_b = [
            torch.zeros(max_loras, size, max_rank, dtype=weight.dtype, device=weight.device)
            for size in self.output_sizes
        ]

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def set_lora(self, slot: int, weights: Optional[LoRALayerWeights]) -> None:
        """Load an adapter's weights for this layer into `slot` (None: the adapter skips it)."""
        for i in range(len(self.output_sizes)):
            self.lora_a[i][slot].zero_()
            self.lora_b[i][slot].zero_()
            if weights is None or weights.lora_a[i] is None:
                continue
            a, b = weights.lora_a[i], weights.lora_b[i]
            rank = a.shape[0]
            self.lora_a[i][slot, :rank].copy_(a, non_blocking=True)
            self.lora_b[i][slot, :, :rank].copy_(b, non_blocking=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)  # [num_tokens, sum(output_sizes)]
        self.punica.add_lora(y, x, self.lora_a, self.lora_b, self.output_sizes)
        return y
