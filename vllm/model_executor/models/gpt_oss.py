"""gpt-oss (`GptOssForCausalLM`, bf16 checkpoints): the common decoder with attention
biases, a learned attention sink per query head (`self_attn.sinks`), layers that
alternate sliding-window and full attention (`config.layer_types`), YaRN RoPE, and a
mixture of `num_local_experts` experts in every layer.

Its MoE, as options of the shared op (vllm/model_executor/layers/fused_moe.py): the
router has a bias and keeps the top `num_experts_per_tok` logits, softmaxed over those
alone ("topk_softmax"); both expert projections have biases; the activation is the
clamped SwiGLU ("swiglu_clamped", `swiglu_alpha`, `swiglu_limit`).

Checkpoint layout (what transformers 5 writes and the dequantized published weights
use), converted at load:
    mlp.router.weight [E, H], .bias [E]         -> mlp.gate (the router)
    mlp.experts.gate_up_proj [E, H, 2I]         -> experts.w13.weight [E, 2I, H]
        transposed, and its columns interleaved (gate 0, up 0, gate 1, up 1, ...)
        split into our gate-rows-then-up-rows order
    mlp.experts.gate_up_proj_bias [E, 2I]       -> experts.w13.bias (same split)
    mlp.experts.down_proj [E, I, H]             -> experts.w2.weight [E, H, I] (transposed)
    mlp.experts.down_proj_bias [E, H]           -> experts.w2.bias

Invariants:
- Quantized checkpoints (`quantization_config`, e.g. the MXFP4 experts
  openai/gpt-oss-20b ships) are refused by the loader, naming the method, with
  `quantized_checkpoint_hint` on how to get a bf16 checkpoint.
- Attention (q/k/v/o, with their biases) is the common decoder's, so LoRA and aLoRA
  reach it unchanged; expert and router weights are never adaptable.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

import torch

from vllm.model_executor.layers.fused_moe import ExpertActivation, MoEOptions
from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM
from vllm.model_executor.models.moe import MoEForCausalLM


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up alternating along the last dim -> [..., 2I] gates then ups."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def convert_expert_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A gpt-oss checkpoint tensor in the layout our stacked expert weights use (see the
    module docstring); every other tensor is returned as it is."""
    if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I] -> [E, 2I, H]
        return deinterleave_gate_up(tensor).transpose(1, 2)
    if name.endswith(".experts.gate_up_proj_bias"):  # [E, 2I]
        return deinterleave_gate_up(tensor)
    if name.endswith(".experts.down_proj"):  # [E, I, H] -> [E, H, I]
        return tensor.transpose(1, 2)
    return tensor


def _clamped_swiglu(config: Any) -> ExpertActivation:
    """gpt-oss's activation; configs from transformers before `swiglu_alpha` was a field (5.17
    hard-codes it in the model) fall back to the released model's values, the dataclass defaults."""
    default = ExpertActivation("swiglu_clamped")
    return replace(default, alpha=getattr(config, "swiglu_alpha", default.alpha),
                   limit=getattr(config, "swiglu_limit", default.limit))


class GptOssForCausalLM(MoEForCausalLM, LlamaForCausalLM):
    checkpoint_renames = ((".mlp.router.", ".mlp.gate."),)
    # Appended to the loader's refusal of quantized checkpoints (model_loader.check_not_prequantized).
    quantized_checkpoint_hint = ("e.g. gpt-oss with its MXFP4 experts dequantized to bf16: transformers' "
                                 "Mxfp4Config(dequantize=True), then save_pretrained")

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        # Attention biases come from `attention_bias` (the common decoder); no dense MLP is built.
        return replace(super().decoder_options(config), attention_sinks=True)

    @classmethod
    def moe_options(cls, config: Any) -> MoEOptions:
        return MoEOptions(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            scoring="topk_softmax",
            router_bias=True,
            expert_bias=True,
            activation=_clamped_swiglu(config),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, convert_expert_tensor(name, tensor)) for name, tensor in weights)
