"""The CUDA-graph decode path (vllm/worker/cuda_graph.py), checked on the CPU: the buffer
layout and in-place updates, padding and un-padding, and replays that read this step's inputs
and adapter mapping rather than the captured ones. `EagerReplayBackend` stands in for the
graph: a replay re-runs the captured closure over the captured buffers and metadata objects."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.conftest import INVOCATION
from tests.utils.logs import logged_messages
from vllm import LLM, SamplingParams
from vllm.lora.ops import torch_ops
from vllm.lora.punica import LoRAKernelMeta, PunicaWrapper
from vllm.lora.request import LoRARequest
from vllm.worker.cuda_graph import DecodeGraphBuffers, EagerReplayBackend, capture_sizes, padded_size
from vllm.worker.input_batch import StepInputs

MAX_NEW = 12


def test_capture_sizes_and_padding():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1000)[-1] == 512
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 20, 21)] == [1, 4, 8, 8, 16, 20, None]


def _decode_inputs(seq_lens: list[int], width: int) -> StepInputs:
    n = len(seq_lens)
    return StepInputs(
        req_ids=[str(i) for i in range(n)], input_ids=np.arange(10, 10 + n, dtype=np.int64),
        positions=np.array(seq_lens, dtype=np.int64) - 1, slot_mapping=np.arange(100, 100 + n, dtype=np.int64),
        query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=np.array(seq_lens, dtype=np.int32),
        block_table=np.arange(1, 1 + n * width, dtype=np.int32).reshape(n, width), num_decodes=n,
        token_lora_mapping=None, sample_rows=list(range(n)), logits_indices=np.arange(n), prompt_logprob_spans={},
    )


def test_buffers_are_written_in_place_with_pad_rows_reset():
    buffers = DecodeGraphBuffers(8, 6, torch.device("cpu"))
    pointers = [t.data_ptr() for t in (buffers.input_ids, buffers.slot_mapping, buffers.seq_lens, buffers.block_table)]
    buffers.write(_decode_inputs([5, 9, 17, 3, 4], width=3), size=8)
    buffers.write(_decode_inputs([6, 10, 18], width=2), size=4)  # a smaller step after a larger one
    assert [t.data_ptr() for t in (buffers.input_ids, buffers.slot_mapping, buffers.seq_lens,
                                   buffers.block_table)] == pointers
    assert buffers.input_ids[:4].tolist() == [10, 11, 12, 0]
    assert buffers.slot_mapping[:4].tolist() == [100, 101, 102, -1]  # the pad row is never stored
    assert buffers.seq_lens[:4].tolist() == [6, 10, 18, 1] == buffers.seq_lens_cpu[:4].tolist()
    assert buffers.block_table[:4].tolist() == [[1, 2, 0, 0, 0, 0], [3, 4, 0, 0, 0, 0], [5, 6, 0, 0, 0, 0],
                                                [0] * 6]  # the previous step's wider rows are cleared
    meta = buffers.metadata(4, max_model_len=64)
    assert (meta.num_decodes, meta.num_actual_tokens, meta.max_query_len) == (4, 4, 1)
    assert meta.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()  # views, not copies
    with pytest.raises(ValueError, match="A graph step takes 2 decode rows at most, got 3 tokens"):
        buffers.write(_decode_inputs([6, 10, 18], width=2), size=2)


def test_masked_lora_op_matches_the_runs_op():
    """The graph form of the torch LoRA op (every slot, masked by the mapping buffer) equals the
    per-run op, and leaves rows without an adapter as they were."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 16, generator=gen), torch.randn(9, 24, generator=gen)
    lora_a = [torch.randn(3, 4, 16, generator=gen) for _ in range(2)]
    lora_b = [torch.randn(3, 12, 4, generator=gen) for _ in range(2)]
    mapping = np.array([2, 2, -1, 0, 0, 1, -1, 1, 2], dtype=np.int32)
    punica = PunicaWrapper(16, torch.device("cpu"))
    punica.update(mapping)
    expected = y.clone()
    torch_ops.add_lora(expected, x, lora_a, lora_b, [12, 12], punica.meta)
    punica.update(mapping, graph_size=9)
    assert punica.meta.graph and punica.meta.has_lora and punica.meta.num_tokens == 9
    masked = y.clone()
    torch_ops.add_lora(masked, x, lora_a, lora_b, [12, 12], punica.meta)
    torch.testing.assert_close(masked, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(masked[[2, 6]], y[[2, 6]])
    assert not LoRAKernelMeta().has_lora


def _count_replays(runner) -> list[int]:
    count = [0]
    for size, graph in runner.graphs.graphs.items():
        original = graph.replay

        def replay(original=original):
            count[0] += 1
            original()

        graph.replay = replay
    return count


@pytest.fixture(scope="module")
def eager_and_graph(llama_dir):
    def build(graphs: bool) -> LLM:
        llm = LLM(llama_dir, max_model_len=256, enable_lora=True, enable_activated_lora=True, max_loras=3,
                  max_lora_rank=8, max_num_seqs=6)
        if graphs:
            llm.llm_engine.engine_core.runner.capture_cuda_graphs(EagerReplayBackend())
        return llm

    return build(False), build(True)


def test_graph_decodes_match_eager_with_mixed_adapters(eager_and_graph, adapters, tokenizer):
    """Captured with no adapter active; replays serve base, LoRA and aLoRA rows in one batch
    (5 sequences padded to 8, then fewer as they finish): tokens identical, logprobs equal."""
    eager, graph = eager_and_graph
    runner = graph.llm_engine.engine_core.runner
    assert runner.graphs.enabled and sorted(runner.graphs.graphs) == [1, 2, 4, 6]
    replays = _count_replays(runner)
    requests = [None, LoRARequest("lora_all", 1, adapters["lora_all"]),
                LoRARequest("alora_certainty", 2, adapters["alora_certainty"]),
                LoRARequest("lora_qkv", 3, adapters["lora_qkv"]), None]
    texts = ["What is the capital of France?", "The quick brown fox", "Is this certain? " + INVOCATION,
             "one two three four five", "Hello there"]
    prompts = [{"prompt_token_ids": tokenizer.encode(t)} for t in texts]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW - i, ignore_eos=True, logprobs=1) for i in range(5)]
    ours = graph.generate(prompts, params, lora_request=requests, use_tqdm=False)
    reference = eager.generate(prompts, params, lora_request=requests, use_tqdm=False)
    assert replays[0] >= MAX_NEW - 5  # decode steps went through the graph path
    for a, b in zip(ours, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(lp_a[t].logprob - lp_b[t].logprob) < 1e-5
    assert graph.llm_engine.get_stats().kv_cache_usage == 0.0


def test_prompt_logprobs_and_large_batches_run_eagerly(eager_and_graph, tokenizer):
    _, graph = eager_and_graph
    runner = graph.llm_engine.engine_core.runner
    replays = _count_replays(runner)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    graph.generate([{"prompt_token_ids": tokenizer.encode("a b c")}], params, use_tqdm=False)
    assert replays[0] == 0  # a one-token request only prefills: nothing to replay


class _FailingBackend:
    def capture(self, fn, meta):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_failed_capture_warns_and_runs_eagerly(llama_dir, tokenizer):
    llm = LLM(llama_dir, max_model_len=128, max_num_seqs=4)
    runner = llm.llm_engine.engine_core.runner
    with logged_messages("vllm.worker.cuda_graph", logging.WARNING) as messages:
        runner.capture_cuda_graphs(_FailingBackend())
    assert not runner.graphs.enabled
    assert messages == ["CUDA graph capture failed, running every step eagerly: RuntimeError: "
                                "operation not permitted when stream is capturing"]
    out = llm.generate([{"prompt_token_ids": tokenizer.encode("Hello")}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_enforce_eager_reaches_the_model_config(llama_dir):
    llm = LLM(llama_dir, max_model_len=64, enforce_eager=True)
    assert llm.llm_engine.vllm_config.model_config.enforce_eager
    assert llm.llm_engine.engine_core.runner.graphs is None
