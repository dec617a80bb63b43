"""A compact LLM inference and serving engine with vLLM's public API and first-class
Activated LoRA (aLoRA) support.

Public names are imported on first use, so `vllm --version` and light imports such
as `vllm.lora.request` do not load torch and transformers.
"""

import importlib

from vllm.version import __version__

_EXPORTS = {
    "LLM": "vllm.entrypoints.llm",
    "EngineArgs": "vllm.engine.arg_utils",
    "SamplingParams": "vllm.sampling_params",
    "StructuredOutputsParams": "vllm.sampling_params",
    "RequestOutputKind": "vllm.sampling_params",
    "RequestOutput": "vllm.outputs",
    "CompletionOutput": "vllm.outputs",
    "Logprob": "vllm.outputs",
    "PromptType": "vllm.inputs",
    "TextPrompt": "vllm.inputs",
    "TokensPrompt": "vllm.inputs",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
