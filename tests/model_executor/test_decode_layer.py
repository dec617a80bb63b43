"""The native decoder layers for CPU decodes (vllm/model_executor/layers/decode_layer.py,
vllm/csrc/cpu/decode_layer.cpp): which layers it takes, one call per run of consecutive native
layers and step, and that where it runs the engine's tokens and logprobs are bitwise those of the
Python layers it replaces (fp32, bf16, int8, int4, qkv biases, Granite's multipliers, a sliding
window, batched decodes, a run broken by a layer that stays Python)."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers import decode_layer, dense_gemv, quantization
from tests.conftest import INVOCATION
from tests.utils.adapters import make_adapter
from tests.utils.native_layers import PROMPTS, both_paths, count_native_calls, greedy_run, native_layers


@pytest.mark.parametrize(("arch", "engine"), [
    ("llama", dict(dtype="float32")),
    ("llama", dict(dtype="bfloat16")),
    ("llama", dict(dtype="float32", quantization="int8")),
    ("llama", dict(dtype="float32", quantization="int4")),
    ("llama", dict(dtype="bfloat16", quantization="int4")),  # quantized linears on bf16 activations
    ("qwen2", dict(dtype="float32")),  # q/k/v biases
    ("granite", dict(dtype="float32")),  # residual and attention multipliers
    ("mistral_window", dict(dtype="float32")),  # a sliding window shorter than the prompts
])
def test_native_layers_give_the_python_layers_bits(arch, engine, checkpoints, tokenizer, monkeypatch):
    calls = count_native_calls(monkeypatch)
    llm = LLM(checkpoints[arch], max_model_len=128, **engine)
    native, python = both_paths(llm, tokenizer)
    layers = native_layers(llm)
    assert all(layer._native_decode is not None for layer in layers)  # the first with a zero residual
    assert calls and max(calls) <= layers[1]._native_decode.max_rows and 3 in calls  # batched decodes ran natively
    assert native == python  # tokens and logprobs, bit for bit


def test_one_call_per_run_of_native_layers_and_step(tmp_path, tokenizer, monkeypatch):
    """Five layers, the third kept Python (as a layer outside the plain form would be): runs [0, 1]
    (the first layer with a zero residual) and [3, 4], two native calls a decode step, and the
    Python layers' bits."""
    from tests.utils.checkpoints import make_checkpoint

    path = make_checkpoint(str(tmp_path / "llama5"), "llama", num_hidden_layers=5)
    calls = count_native_calls(monkeypatch)
    llm = LLM(path, max_model_len=128, dtype="float32")
    layers = native_layers(llm)
    layers[2]._native_decode, layers[2]._native_decode_built = None, True  # before the first forward
    native, python = both_paths(llm, tokenizer)
    runs = llm.llm_engine.engine_core.runner.model.model._native_runs
    assert {start: stack.layers for start, stack in runs.items()} == {0: layers[0:2], 3: layers[3:5]}
    assert calls and len(calls) % 2 == 0 and native == python


def test_a_stack_refuses_arguments_that_are_not_whole_layers():
    assert decode_layer.native_available()
    weights = [torch.ones(1)] * 39
    with pytest.raises(RuntimeError, match="expected 39 weights, 18 ints and 4 floats per layer, got 39, 17 and 4"):
        torch.classes.vllm_layer.DecodeStack(weights, [0] * 17, [0.0] * 4)


def test_prefills_and_long_chunks_stay_python(llama_dir, tokenizer, monkeypatch):
    calls = count_native_calls(monkeypatch)
    llm = LLM(llama_dir, max_model_len=128, dtype="float32")
    prompt = tokenizer.encode("one two three four five six seven eight nine ten " * 3)
    assert len(prompt) > dense_gemv.NATIVE_MAX_ROWS
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert calls == []  # a prefill's rows exceed the few-row kernels


def test_quantized_steps_of_many_rows_run_natively(llama_dir, tokenizer, monkeypatch):
    """int4 linears run natively up to quantization.native_max_rows rows, so an int4 model's
    layers take steps of as many rows, prompts included: bit for bit the Python layers'."""
    calls = count_native_calls(monkeypatch)
    llm = LLM(llama_dir, max_model_len=128, dtype="float32", quantization="int4")
    prompts = PROMPTS + ["one two three four five six seven eight nine ten " * 3]
    native, python = both_paths(llm, tokenizer, prompts=prompts)
    # int4 in row tiles (where the kernel has them, this model's every linear) runs any number of rows natively
    limit = quantization.NATIVE_MAX_ROWS_TILES if quantization.tile_rows() else quantization.NATIVE_MAX_ROWS_INT4
    assert all(layer._native_decode.max_rows == limit for layer in native_layers(llm))
    assert max(calls) > dense_gemv.NATIVE_MAX_ROWS and native == python  # the prompts' step ran natively


def test_a_layer_takes_no_more_rows_than_its_linears(llama_dir, tokenizer, monkeypatch):
    """Past the rows a linear runs natively (dense_gemv.native_max_rows) the Python layer's product
    comes from another matmul, so the native layer leaves those steps to it (three rows a step here)."""
    calls = count_native_calls(monkeypatch)
    for limit, native_steps in ((3, True), (2, False)):
        monkeypatch.setattr(dense_gemv, "native_max_rows", lambda dtype, limit=limit: limit)
        llm = LLM(llama_dir, max_model_len=128, dtype="float32")
        calls.clear()
        native, python = both_paths(llm, tokenizer)
        assert all(layer._native_decode.max_rows == limit for layer in native_layers(llm))
        assert bool(calls) == native_steps and native == python
        del llm


def test_bf16_rows_past_the_gemv_run_the_dot_kernel_natively(llama_dir, tokenizer, monkeypatch):
    """Where the CPU has AVX512-BF16, bf16 steps of more rows than the GEMV takes
    (dense_gemv.layer_rows) stay native and run the vdpbf16ps kernel for the layers' linears, as
    the Python layers do: bit for bit."""
    if not dense_gemv.bf16_dot_available():
        pytest.skip("the vdpbf16ps kernel needs AVX512-BF16")
    calls = count_native_calls(monkeypatch)
    llm = LLM(llama_dir, max_model_len=128, dtype="bfloat16")
    assert dense_gemv.native_max_rows(torch.bfloat16) < 3  # the three-row steps are past the GEMV
    with torch.profiler.profile() as prof:
        native = greedy_run(llm, tokenizer)
    dot_calls = sum(e.count for e in prof.key_averages() if e.key == "vllm_bf16_dot::bf16_dot_linear")
    layers = len(native_layers(llm))
    assert calls.count(3) > 0 and dot_calls >= 4 * layers * calls.count(3)  # four linears a layer
    native_again, python = both_paths(llm, tokenizer)
    assert native == native_again == python


@pytest.mark.parametrize("arch", ["gemma", "qwen3"])  # Gemma's norm and GeGLU; Qwen3's q/k norms
def test_layers_outside_the_plain_form_stay_python(arch, checkpoints, tokenizer, monkeypatch):
    calls = count_native_calls(monkeypatch)
    llm = LLM(checkpoints[arch], max_model_len=128, dtype="float32")
    greedy_run(llm, tokenizer)
    assert calls == [] and all(layer._native_decode is None for layer in native_layers(llm))


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("bfloat16", "int4")])
def test_with_lora_base_and_adapter_steps_run_natively(dtype, quantization, llama_dir, tokenizer, tmp_path,
                                                       monkeypatch):
    """With --enable-lora the Linears are LoRA wrappers: a step without adapter rows adds nothing to
    their base products, and a step with a few adapted rows adds each wrapper's delta with the native
    LoRA op: both run natively, bit for bit the Python layers; so do an aLoRA's decode steps. Past the
    native op's token limit an adapter step runs Python."""
    from vllm.lora.ops import cpu_native

    adapter = make_adapter(llama_dir, str(tmp_path / "lora"), ["q_proj", "v_proj", "down_proj"], r=8, seed=3)
    invocation = tokenizer.encode(INVOCATION, add_special_tokens=False)
    alora_dir = make_adapter(llama_dir, str(tmp_path / "alora"), ["q_proj", "o_proj", "gate_proj"], r=8, seed=4,
                             invocation_tokens=invocation)
    calls = count_native_calls(monkeypatch)
    # No prefix cache: a second run would prefill fewer tokens, and a LoRA delta of few tokens takes the
    # native op where more take the torch op (another summation order), so only the decodes would match.
    llm = LLM(llama_dir, max_model_len=128, dtype=dtype, quantization=quantization, enable_lora=True, max_loras=2,
              max_lora_rank=8, enable_prefix_caching=False)
    native, python = both_paths(llm, tokenizer)
    assert calls and native == python
    calls.clear()
    lora = LoRARequest("lora", 1, adapter)
    native, python = both_paths(llm, tokenizer, lora)
    assert calls and max(calls) <= cpu_native.NATIVE_MAX_TOKENS[getattr(torch, dtype)] and native == python
    lora_tokens = [t for t, _ in native]
    calls.clear()
    prompts = [p + INVOCATION for p in PROMPTS]  # the invocation at each prompt's end
    alora = LoRARequest("alora", 2, alora_dir)
    native, python = both_paths(llm, tokenizer, alora, prompts)
    assert calls and native == python
    if dtype == "float32" and quantization is None:  # the torch ops' tokens (bf16 rounds in other orders)
        monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
        reference = LLM(llama_dir, max_model_len=128, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=8)
        assert [t for t, _ in greedy_run(reference, tokenizer, lora)] == lora_tokens


def test_adapter_steps_past_the_native_lora_ops_limit_run_python(llama_dir, tokenizer, tmp_path, monkeypatch):
    from vllm.lora.ops import cpu_native

    monkeypatch.setattr(cpu_native, "NATIVE_MAX_TOKENS", {torch.float32: 2})
    adapter = make_adapter(llama_dir, str(tmp_path / "lora"), ["q_proj", "v_proj", "down_proj"], r=8, seed=3)
    calls = count_native_calls(monkeypatch)
    llm = LLM(llama_dir, max_model_len=128, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    native, python = both_paths(llm, tokenizer, LoRARequest("lora", 1, adapter))  # three rows a decode step
    assert calls == [] and native == python


def test_reference_ops_turn_it_off(llama_dir, tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    calls = count_native_calls(monkeypatch)
    llm = LLM(llama_dir, max_model_len=128, dtype="float32")
    greedy_run(llm, tokenizer)
    assert calls == [] and all(layer._native_decode is None for layer in native_layers(llm))


def test_kernel_builds_here():
    """CI machines have a compiler: a silent fallback to the Python layers would hide a build break."""
    assert decode_layer.native_available(), decode_layer.native_build.unavailable_reason(
        decode_layer._SOURCE, decode_layer._WHAT)
