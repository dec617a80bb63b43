"""Greedy generation is token-identical to transformers, for every architecture and
under the scheduler's hard cases: default settings, a step budget small enough to
split prompts across steps (chunked prefill mixed with decodes), and a KV cache
small enough to force preemption. Logprobs match within 1e-4 (fp32)."""

import pytest

from tests.utils.checkpoints import ARCHITECTURES, load_hf_model
from tests.utils.reference import hf_greedy
from vllm import LLM, SamplingParams

MAX_NEW = 16
TEXTS = [
    "What is the capital of France?",
    "The quick brown fox",
    "one two three four five six seven eight nine ten eleven twelve " * 3,
    "Héllo wörld",
    "Please answer the question using the documents provided. " * 4,
    "A",
    "Large language models generate text one token at a time from a key value cache.",
    "system user assistant certainty answerability document hallucination query rewrite " * 2,
]

CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=24),
    "preempt": dict(num_gpu_blocks_override=14, block_size=16, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def references(checkpoints, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    refs = {}
    for arch in ARCHITECTURES:
        model = load_hf_model(checkpoints[arch])
        refs[arch] = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return prompts, refs


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch, config, checkpoints, references):
    prompts, refs = references
    llm = LLM(checkpoints[arch], max_model_len=128, **CONFIGS[config])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, (ref_tokens, ref_logprobs) in zip(outputs, refs[arch]):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4
        assert all(len(lp) >= 2 for lp in completion.logprobs)
    stats = llm.llm_engine.get_stats()
    if config == "preempt":
        assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0
