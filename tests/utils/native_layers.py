"""Helpers for tests of the native decoder layers (vllm/model_executor/layers/decode_layer.py):
count the native calls of a run, switch an engine's layers between the native and the Python
path, and decode the same prompts both ways (greedy tokens and their logprobs)."""

from __future__ import annotations

from vllm import LLM, SamplingParams
from vllm.model_executor.layers import decode_layer

PROMPTS = ["What is the capital of France?", "one two three four five six seven eight nine ten eleven twelve",
           "hello"]


def native_layers(llm: LLM) -> list:
    """The engine's decoder layers that may run natively."""
    model = llm.llm_engine.engine_core.runner.model
    return [m for m in model.modules() if hasattr(m, "native_decode_allowed")]


def allow_native(llm: LLM, allowed: bool) -> None:
    for layer in native_layers(llm):
        layer.native_decode_allowed = allowed


def count_native_calls(monkeypatch) -> list[int]:
    """The rows of every native call (one per run of layers and step), as they happen."""
    calls = []
    real = decode_layer.NativeDecodeStack.__call__

    def counting(self, positions, hidden, *args):
        calls.append(hidden.shape[0])
        return real(self, positions, hidden, *args)

    monkeypatch.setattr(decode_layer.NativeDecodeStack, "__call__", counting)
    return calls


def greedy_run(llm: LLM, tokenizer, lora=None, prompts=PROMPTS, max_tokens: int = 10) -> list[tuple[list[int], list]]:
    """Per prompt: greedy tokens and their logprobs; the three PROMPTS decode three rows a step."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    requests = [{"prompt_token_ids": tokenizer.encode(p)} for p in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


def both_paths(llm: LLM, tokenizer, lora=None, prompts=PROMPTS):
    """greedy_run natively, then on the Python layers (then native again allowed)."""
    native = greedy_run(llm, tokenizer, lora, prompts)
    allow_native(llm, False)
    python = greedy_run(llm, tokenizer, lora, prompts)
    allow_native(llm, True)
    return native, python
