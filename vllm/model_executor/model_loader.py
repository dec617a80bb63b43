"""`get_model`: build the model for a `ModelConfig` on a device and fill its weights.

Invariants:
- The model is built directly on `device` in `model_config.dtype` (the checkpoint's
  `torch_dtype` plays no part); parameters start uninitialised (`torch.empty`).
- Real weights are streamed from the checkpoint one tensor at a time into those
  parameters (peak memory: the model plus one tensor).
- `load_format="dummy"` reads no file: small uniform random values, norm weights at
  their identity (1.0; Gemma's 0.0), seeded by `model_config.seed`. For speed benchmarks of large shapes
  (e.g. Granite-3.3-8B in bf16) where only the shapes matter.
- Checkpoints stored quantized (a `quantization_config`: GPTQ, AWQ, FP8, MXFP4...) are
  refused naming the method; `model_config.quantization` (int8, int4) quantizes every
  `Linear` and the LM head (int8 per channel for both methods) once the weights are loaded
  (layers/quantization.py, layers/vocab_embedding.py). On the CPU the quantized kernel and the
  decoder-layer kernel are built (or loaded from cache) here, with the model, not on the first request.
- A GGUF file (`model_config.gguf_path`) loads through gguf_loader.py: its quantized tensors
  go into the `Linear`s and the LM head packed, never through full precision.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.config import ModelConfig
from vllm.logger import init_logger
from vllm.model_executor.gguf_loader import iterate_gguf_weights
from vllm.model_executor.hf_files import find_weight_files, iterate_weights
from vllm.model_executor.layers import decode_layer, dense_gemv, quantization
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.vocab_embedding import LMHead
from vllm.model_executor.models import get_model_class

logger = init_logger(__name__)

# Small enough that activations stay well inside bf16 range through many layers.
DUMMY_WEIGHT_RANGE = 1e-3


def get_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    model_class = get_model_class(model_config.architecture)
    check_not_prequantized(model_config, getattr(model_class, "quantized_checkpoint_hint", ""))
    model = model_class(model_config.hf_config, model_config.dtype, device)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model, model_config.seed)
    elif model_config.gguf_path is not None:  # quantized tensors stay packed (gguf_loader.py)
        model.load_weights(iterate_gguf_weights(model_config.gguf_path, model_config.hf_config))
    else:
        files, fmt = find_weight_files(model_config.model_dir, model_config.load_format)
        model.load_weights(iterate_weights(files, fmt))
    if model_config.quantization is not None:
        for module in model.modules():
            if isinstance(module, (Linear, LMHead)):
                module.quantize(model_config.quantization)
        _log_kept_grids(model)
    if device.type == "cpu" and (model_config.quantization is not None or model_config.gguf_path is not None):
        quantization.native_available()  # build the kernel now, not on the first request
    if device.type == "cpu" and any(hasattr(m, "native_decode_allowed") for m in model.modules()):
        decode_layer.native_available()  # the decoder-layer kernel too (layers/decode_layer.py)
    if device.type == "cpu" and model_config.dtype == torch.bfloat16:
        dense_gemv.bf16_dot_available()  # and bf16's mid-row linear kernel, where the CPU has AVX512-BF16
    return model.eval()


def _log_kept_grids(model: nn.Module) -> None:
    """Say where int4 at load found weights already on a 4-bit grid and kept them (quantization.py)."""
    weights = [w for m in model.modules() if isinstance(m, Linear) for w in m.quantized_weights()]
    kept = sum(w.method == "int4" and w.offsets is not None for w in weights)
    if kept:
        logger.info("int4: %d of %d linear weights already lie on a 4-bit grid (a checkpoint dequantized from "
                    "4 bits) and keep it exactly, with an fp16 min per 32 weights (20 bytes per 32 instead of 18)",
                    kept, len(weights))


def check_not_prequantized(model_config: ModelConfig, hint: str) -> None:
    quant = getattr(model_config.hf_config, "quantization_config", None)
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    raise ValueError(
        f"{model_config.architecture}: quantized checkpoints are not supported (quantization_config has "
        f"quant_method={str(method)!r}). Supported: unquantized bf16, fp16 or fp32 checkpoints"
        f"{' (' + hint + ')' if hint else ''}, optionally quantized at load with --quantization int8 or int4."
    )


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes, generated on the parameters' own device."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=gen)
    # Norm weights scale activations: at identity they keep hidden states at a sane scale.
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(module.identity_weight)
