"""Model registry: HF `architectures[0]` name -> model class.

Every class here implements the model API the model runner calls:
`__init__(hf_config, dtype, device)`, `forward(input_ids, positions, kv_caches,
attn_metadata) -> [num_tokens, hidden]`, `compute_logits(hidden) -> fp32 logits`,
`load_weights(iterable of (name, tensor))`, and `packed_modules_mapping`.
"""

from __future__ import annotations

from torch import nn

from vllm.model_executor.models.gemma import GemmaForCausalLM
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM, Gemma3TextOnlyForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.granite_switch import GraniteSwitchForCausalLM
from vllm.model_executor.models.granitemoe import GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM, MistralForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.olmoe import OlmoeForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    # The format's three architecture names are one class (Shadow-Residual ones are refused at config load).
    "GraniteSwitchForCausalLM": GraniteSwitchForCausalLM,
    "SRSwitchForCausalLM": GraniteSwitchForCausalLM,
    "ShadowResidualForCausalLM": GraniteSwitchForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # Gemma: GemmaRMSNorm, GeGLU, scaled embeddings; 2 and 3 add four norms per layer and
    # alternate sliding-window and global layers (3: text only, per-layer-type RoPE).
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3TextOnlyForCausalLM,  # its language model, text only
    # Mixture of experts (vllm/model_executor/layers/fused_moe.py).
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"Model architecture {architecture} is not supported. Supported: {', '.join(supported_architectures())}."
        )
    return _MODELS[architecture]
