"""Bad input is a ValueError naming the field and the allowed values, and the engine
keeps serving afterwards."""

import json
import os
import shutil

import pytest

from vllm import LLM, SamplingParams


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-0.5), "temperature must be non-negative"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(n=0), "n must be at least 1"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_request_validation_and_engine_keeps_serving(llm):
    tok = llm.get_tokenizer()
    with pytest.raises(ValueError, match="longer than the maximum model length of 256"):
        llm.generate([{"prompt_token_ids": [5] * 300}], use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"Prompt token ids must be in \[0,"):
        llm.generate([{"prompt_token_ids": [1, 10**6]}], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids contains token ids outside"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="Unsupported prompt"):
        llm.generate([42], use_tqdm=False)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        from vllm.lora.request import LoRARequest

        llm.generate(["hi"], lora_request=LoRARequest("x", 1, "/nonexistent"), use_tqdm=False)
    with pytest.raises(ValueError, match="2 entries but there are 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    # A batch where one prompt is bad leaves nothing behind.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["still serving"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and tok is not None
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_engine_option_validation(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=100000)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(llama_dir, max_model_len=256, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        LLM(llama_dir, max_num_seqs=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be a non-negative integer"):
        LLM(llama_dir, long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        LLM(llama_dir, max_model_len=128, long_prefill_token_threshold=16, enable_chunked_prefill=False,
            max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="dtype"):
        LLM(llama_dir, dtype="int3")
    with pytest.raises(TypeError, match="Unknown LLM option"):
        LLM(llama_dir, not_an_option=1)
    # Unknown architecture and a folder without weights.
    bad_arch = tmp_path / "bad_arch"
    shutil.copytree(llama_dir, bad_arch)
    config = json.loads((bad_arch / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (bad_arch / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM is not supported"):
        LLM(str(bad_arch))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(llama_dir, no_weights)
    for name in os.listdir(no_weights):
        if name.endswith(".safetensors"):
            os.remove(no_weights / name)
    with pytest.raises(ValueError, match="no_weights"):
        LLM(str(no_weights))
