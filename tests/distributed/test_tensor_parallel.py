"""Tensor parallelism on the CPU (gloo, 2 ranks): tokens identical to one rank and logprobs
within 1e-4 (fp32) for the base model, plain LoRA, aLoRA, a mixed batch, structured output and
prefix-cache reuse; per-rank KV heads (split and replicated), sharded biases and attention sinks;
a rank that dies fails the engine at once, one that hangs after VLLM_TP_TIMEOUT_S, and neither
leaves a process behind.

Each TP=2 engine starts one worker process (spawn): the engines are module-scoped and shut
down explicitly, since a process can be in one tensor-parallel group at a time."""

from __future__ import annotations

import gc
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import INVOCATION
from tests.entrypoints.utils import RemoteOpenAIServer
from tests.utils.checkpoints import make_checkpoint
from vllm import LLM, SamplingParams
from vllm.distributed import parallel_state
from vllm.executor.multiproc import TensorParallelError, parse_core_binding
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.tensor_parallel import head_shard, kv_heads_per_rank, vocab_range
from vllm.sampling_params import StructuredOutputsParams

PROMPTS = ["hello world how are you", "the quick brown fox jumps", "one two three four five six seven eight"]
ENGINE = dict(dtype="float32", max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True, **kwargs)


def _engine(path: str, tp: int, **kwargs) -> LLM:
    return LLM(path, tensor_parallel_size=tp, **{**ENGINE, **kwargs})


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def _assert_same(reference, outputs) -> None:
    for ref, out in zip(reference, outputs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for want, got in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
            token = next(iter(want))
            assert abs(got[token].logprob - want[token].logprob) < 1e-4


@pytest.fixture(scope="class")
def pair(llama_dir):
    """(TP=1 engine, TP=2 engine) on the tiny llama with LoRA on."""
    single = _engine(llama_dir, 1)
    double = _engine(llama_dir, 2)
    yield single, double
    _shutdown(double)


def _requests(adapters):
    lora = LoRARequest("lora_all", 1, adapters["lora_all"])
    alora = LoRARequest("alora_certainty", 2, adapters["alora_certainty"])
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[1] + INVOCATION, PROMPTS[2] + INVOCATION]
    loras = [None, None, None, lora, alora, alora]
    return prompts, loras


class TestAdaptersAndFeatures:
    """Shares one pair of engines; the group is left before the other tests start their own."""

    def test_base_lora_alora_and_a_mixed_batch(self, pair, adapters):
        _base_lora_alora_and_a_mixed_batch(pair, adapters)

    def test_structured_output_and_prefix_reuse(self, pair, adapters):
        _structured_output_and_prefix_reuse(pair, adapters)


def _base_lora_alora_and_a_mixed_batch(pair, adapters):
    single, double = pair
    _assert_same(single.generate(PROMPTS, _greedy()), double.generate(PROMPTS, _greedy()))
    prompts, loras = _requests(adapters)
    for prompt, lora in zip(prompts[3:], loras[3:]):  # one at a time
        _assert_same(single.generate([prompt], _greedy(), lora_request=lora),
                     double.generate([prompt], _greedy(), lora_request=lora))
    _assert_same(single.generate(prompts, _greedy(), lora_request=loras),  # all in one batch
                 double.generate(prompts, _greedy(), lora_request=loras))


def _structured_output_and_prefix_reuse(pair, adapters):
    single, double = pair
    texts = []
    for spec in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(choice=["yes", "no", "maybe"])):
        params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=1, structured_outputs=spec)
        ref, out = single.generate(PROMPTS[:1], params), double.generate(PROMPTS[:1], params)
        _assert_same(ref, out)
        assert out[0].outputs[0].finish_reason == "stop"
        texts.append(out[0].outputs[0].text)
    assert isinstance(json.loads(texts[0])["a"], int) and texts[1] in ("yes", "no", "maybe")
    # A conversation, then an aLoRA call on it: the second reuses the base model's KV blocks.
    conversation = " ".join(PROMPTS) * 3
    alora = LoRARequest("alora_certainty", 2, adapters["alora_certainty"])
    for llm in pair:
        llm.generate([conversation], _greedy())
    ref = single.generate([conversation + INVOCATION], _greedy(), lora_request=alora)
    out = double.generate([conversation + INVOCATION], _greedy(), lora_request=alora)
    _assert_same(ref, out)
    assert out[0].num_cached_tokens == ref[0].num_cached_tokens > 0


@pytest.mark.parametrize("arch, overrides", [("gpt_oss", {}), ("qwen2", {"num_key_value_heads": 1})],
                         ids=["sinks_biases_moe", "replicated_kv_head"])
def test_other_layouts_match_one_rank(tmp_path, arch, overrides):
    # gpt-oss: attention sinks split by head, o_proj bias added once after the all-reduce,
    # experts replicated; qwen2 with one KV head: each rank keeps a copy of it.
    path = make_checkpoint(str(tmp_path / arch), arch, **overrides)
    reference = LLM(path, dtype="float32", max_model_len=256).generate(PROMPTS, _greedy())
    double = LLM(path, dtype="float32", max_model_len=256, tensor_parallel_size=2)
    try:
        _assert_same(reference, double.generate(PROMPTS, _greedy()))
    finally:
        _shutdown(double)


def test_a_killed_rank_fails_the_engine_and_leaves_no_process(llama_dir):
    llm = _engine(llama_dir, 2)
    executor = llm.llm_engine.engine_core.runner
    worker = executor.workers[0].process
    reasons = []
    executor.add_failure_callback(reasons.append)
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reasons and "rank 1 exited" in reasons[0]
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.generate(PROMPTS[:1], _greedy())
    _shutdown(llm)
    assert not worker.is_alive() and not parallel_state.get_tp().world_size > 1


def test_a_hung_rank_fails_the_step_after_the_timeout(llama_dir, monkeypatch):
    monkeypatch.setenv("VLLM_TP_TIMEOUT_S", "3")
    llm = _engine(llama_dir, 2)
    worker = llm.llm_engine.engine_core.runner.workers[0].process
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TensorParallelError):
            llm.generate(PROMPTS[:1], _greedy())
        assert time.monotonic() - started < 30
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        _shutdown(llm)
    assert not worker.is_alive()


def test_deleting_the_llm_stops_its_ranks(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=256, tensor_parallel_size=2)
    worker = llm.llm_engine.engine_core.runner.workers[0].process
    del llm
    gc.collect()
    worker.join(15)
    assert not worker.is_alive() and parallel_state.get_tp().world_size == 1


def test_shards_cut_heads_vocab_and_cores(monkeypatch):
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(rank=3, world_size=4))
    heads = head_shard(num_heads=8, num_kv_heads=2, head_size=16)  # 2 KV heads for 4 ranks: replicated
    assert (heads.num_heads, heads.num_kv_heads, heads.first_head) == (2, 1, 6)
    assert heads.qkv.out_ranges == ((96, 32), (16, 16), (16, 16)) and heads.o.in_range == (96, 32)
    assert kv_heads_per_rank(2, 4) == 1 and kv_heads_per_rank(8, 4) == 2
    assert vocab_range(629) == (474, 158)  # ceil(629 / 4) rows; the last block holds 155 real ones
    with pytest.raises(ValueError, match="must divide the number of attention heads"):
        head_shard(num_heads=6, num_kv_heads=2, head_size=16)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        head_shard(num_heads=12, num_kv_heads=3, head_size=16)
    assert parse_core_binding("0-1|2,3", 2) == [[0, 1], [2, 3]] and parse_core_binding(None, 2) is None
    with pytest.raises(ValueError, match="one per rank"):
        parse_core_binding("0-3", 2)
    with pytest.raises(ValueError, match="disjoint"):
        parse_core_binding("0-2|2-3", 2)


def test_bad_parallel_options_are_clear_errors(llama_dir):
    with pytest.raises(ValueError, match="distributed_executor_backend='ray' is not supported"):
        LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the number of attention heads"):
        LLM(llama_dir, tensor_parallel_size=3, dtype="float32")
    assert parallel_state.get_tp().world_size == 1  # the failed start left no group behind


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def _is_rank_worker(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ")
    return b"spawn_main" in command


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads child processes from /proc")
def test_server_with_a_dead_rank_answers_503_and_exits_non_zero(llama_dir):
    with RemoteOpenAIServer(llama_dir, ["--max-model-len", "256", "-tp", "2", "--dtype", "float32"]) as server:
        workers = [p for p in _children(server.proc.pid) if _is_rank_worker(p)]
        assert len(workers) == 1
        client = server.client()
        assert client.completions.create(model=llama_dir, prompt="hello", max_tokens=4).usage.completion_tokens == 4
        stream = client.completions.create(model=llama_dir, prompt="hello", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        statuses = []
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(server.url + "/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert server.proc.wait(timeout=30) != 0
        assert set(statuses) <= {503}  # until it exits (at once: nothing is left in flight), /health says 503
        assert "rank 1" in server.output()
