"""The offline `LLM` as vLLM users call it: `from_engine_args`, the `chat_template`,
`tokenizer_mode`, `max_logprobs` and `hf_overrides` options, `get_metrics()` and
`start_profile()`/`stop_profile()`."""

from __future__ import annotations

import argparse
import glob
import gzip
import json

import pytest

from vllm import LLM, EngineArgs, SamplingParams
from vllm.v1.metrics.reader import Counter, Gauge

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
MESSAGES = [{"role": "user", "content": "hi"}]


def test_from_engine_args(llama_dir):
    llm = LLM.from_engine_args(EngineArgs(model=llama_dir, max_model_len=128, max_num_seqs=3))
    config = llm.llm_engine.vllm_config
    assert config.model_config.max_model_len == 128 and config.scheduler_config.max_num_seqs == 3
    assert config.scheduler_config.max_num_batched_tokens == 8192  # the offline default, as LLM(...)
    assert llm.generate(["hello"], ONE_TOKEN, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_template_option_is_the_default_of_chat(llama_dir, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    llm = LLM(llama_dir, max_model_len=128, chat_template=str(path))
    assert llm.chat(MESSAGES, ONE_TOKEN, use_tqdm=False)[0].prompt == "[user]hi"
    # The call's own template wins.
    own = llm.chat(MESSAGES, ONE_TOKEN, use_tqdm=False, chat_template="<{{ messages[0]['content'] }}>")
    assert own[0].prompt == "<hi>"
    # Jinja text works as well as a file; without the option the tokenizer's template is used.
    inline = LLM(llama_dir, max_model_len=128, chat_template="({{ messages[0]['content'] }})")
    assert inline.chat(MESSAGES, ONE_TOKEN, use_tqdm=False)[0].prompt == "(hi)"
    default = LLM(llama_dir, max_model_len=128).chat(MESSAGES, ONE_TOKEN, use_tqdm=False)[0].prompt
    assert default.startswith("<|start_of_role|>system")


def test_bad_chat_template_fails_at_construction(llama_dir):
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        LLM(llama_dir, chat_template="no-such-template.jinja")


def test_tokenizer_mode(llama_dir, monkeypatch):
    import vllm.tokenizer

    calls = []
    original = vllm.tokenizer.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        calls.append(kwargs.get("use_fast"))
        return original(path, **kwargs)

    monkeypatch.setattr(vllm.tokenizer.AutoTokenizer, "from_pretrained", spy)
    slow = LLM(llama_dir, max_model_len=128, tokenizer_mode="slow")
    assert calls == [False]
    assert slow.generate(["hello"], ONE_TOKEN, use_tqdm=False)[0].outputs[0].token_ids
    LLM(llama_dir, max_model_len=128, tokenizer_mode="auto")
    assert calls == [False, True]
    with pytest.raises(ValueError, match=r"tokenizer_mode 'mistral' is not supported.*'auto', 'slow'"):
        LLM(llama_dir, tokenizer_mode="mistral")


def test_max_logprobs_and_callable_hf_overrides(llama_dir):
    def shorter(config):
        config.max_position_embeddings = 96
        return config

    llm = LLM(llama_dir, max_logprobs=2, hf_overrides=shorter)
    assert llm.llm_engine.model_config.max_model_len == 96
    with pytest.raises(ValueError, match="greater than max allowed: 2"):
        llm.generate(["hello"], SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)
    out = llm.generate(["hello"], SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 2


def test_cli_flags_for_the_new_options():
    parser = argparse.ArgumentParser()
    parser.add_argument("--chat-template")  # the server defines its own; it is kept, not duplicated
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--tokenizer-mode", "slow", "--scheduling-policy", "priority", "--chat-template", "t"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.tokenizer_mode, engine_args.scheduling_policy, engine_args.chat_template) == (
        "slow", "priority", "t")


def test_get_metrics(llama_dir):
    llm = LLM(llama_dir, max_model_len=128, served_model_name="tiny")
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(5, 35))}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert all(m.labels == {"model_name": "tiny", "engine": "0"} for m in metrics.values())
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert isinstance(metrics[name], Gauge) and metrics[name].value == 0.0
    counters = {name: m.value for name, m in metrics.items() if isinstance(m, Counter)}
    assert counters["vllm:prompt_tokens"] == 50
    assert counters["vllm:generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outputs) == 6
    assert counters["vllm:prefix_cache_queries"] == 50 and counters["vllm:prefix_cache_hits"] == 16
    assert counters["vllm:num_preemptions"] == 0 and counters["vllm:alora_reused_prompt_tokens"] == 0


def test_profile_writes_a_trace(llm, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="set VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    llm.stop_profile()
    traces = glob.glob(str(tmp_path / "traces" / "*.pt.trace.json.gz"))
    assert len(traces) == 1
    with gzip.open(traces[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "engine_step" for e in events)
    with pytest.raises(RuntimeError, match="No profile is running"):
        llm.stop_profile()
