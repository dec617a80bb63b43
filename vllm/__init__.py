"""A compact LLM inference and serving engine with vLLM's public API and first-class
Activated LoRA (aLoRA) support."""

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.llm import LLM
from vllm.inputs import PromptType, TextPrompt, TokensPrompt
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.version import __version__

__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
