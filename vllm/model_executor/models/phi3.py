"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with no biases;
what sets the family apart lives elsewhere and needs nothing here but this class:

- the checkpoint already stores the fused `qkv_proj` ([q | k | v] rows) and
  `gate_up_proj` ([gate | up] rows), in the row order of our fused linears, so each
  loads whole into its parameter (the loader only splits q/k/v or gate/up tensors);
- `longrope` scaling with a top-level `original_max_position_embeddings` and Phi-4-mini's
  `partial_rotary_factor` are read by vllm/model_executor/layers/rotary.py;
- tied (Phi-4-mini) or untied (Phi-3) embeddings follow `tie_word_embeddings`;
- PEFT adapters trained on Phi-3 target the checkpoint's fused modules by name:
  `peft_module_aliases` maps `qkv_proj` / `gate_up_proj` onto every slice of ours (one
  A, B split by rows), as Granite 4's fused MLP;
- a sliding window (Phi-3-mini-4k: 2047 of 4096) goes through the common decoder's
  handling of windows, as for every family.

Phi-3-small (`Phi3SmallForCausalLM`: blocksparse attention, GEGLU) and Phi-3.5-MoE are
other architectures and are not registered.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # PEFT module suffix -> (our module suffix, slice index or None for every slice).
    peft_module_aliases = {
        "self_attn.qkv_proj": ("self_attn.qkv_proj", None),
        "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
    }

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions()
