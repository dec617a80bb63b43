"""Prefix caching through the whole engine: hits are reported, outputs are unchanged,
and eviction under memory pressure stays correct."""

import pytest

from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(tokenizer, n_tokens, seed_text="one two three four five six seven eight nine ten "):
    ids = tokenizer.encode(seed_text * 20)
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def test_shared_three_block_prefix_reports_48_cached(llama_dir, tokenizer):
    prefix = _prompt(tokenizer, 48)
    second = prefix + tokenizer.encode(" What is the capital of France?")
    cached = LLM(llama_dir, max_model_len=256, block_size=16)
    uncached = LLM(llama_dir, max_model_len=256, block_size=16, enable_prefix_caching=False)
    first = cached.generate([{"prompt_token_ids": prefix + [5]}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    hit = cached.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    ref = uncached.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48 and ref.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    stats = cached.llm_engine.get_stats()
    assert stats.prefix_cache_hits == 48


def test_eviction_under_pressure_stays_correct(llama_dir, tokenizer):
    # 10 blocks of 16 tokens: every new prompt evicts older cached blocks.
    small = LLM(llama_dir, max_model_len=64, block_size=16, num_gpu_blocks_override=10, max_num_batched_tokens=64)
    reference = LLM(llama_dir, max_model_len=64, enable_prefix_caching=False)
    texts = ["one two three ", "The quick brown fox ", "Héllo wörld ", "What is the capital "]
    prompts = [_prompt(tokenizer, 40, t) for t in texts]
    expected = [o.outputs[0].token_ids for o in reference.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    for round_ in range(3):
        for prompt, tokens in zip(prompts, expected):
            out = small.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == tokens
    # Concurrent shared-prefix requests under pressure.
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.llm_engine.get_stats().kv_cache_usage == 0.0


def test_cache_salt_isolates(llama_dir, tokenizer):
    llm = LLM(llama_dir, max_model_len=256)
    prompt = _prompt(tokenizer, 40)
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], GREEDY, use_tqdm=False)
    other = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}], GREEDY, use_tqdm=False)[0]
    same = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 32


def test_uninitialised_cache_memory_is_harmless(llama_dir, tokenizer):
    """KV caches are allocated uninitialised; blocks are zeroed when handed out, so
    NaNs left in memory never reach attention (decode reads whole padded blocks)."""
    llm = LLM(llama_dir, max_model_len=256, block_size=16)
    for cache in llm.llm_engine.engine_core.runner.kv_caches:
        cache.fill_(float("nan"))
    prompts = [_prompt(tokenizer, n) for n in (5, 17, 40, 33)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    reference = LLM(llama_dir, max_model_len=256, enable_prefix_caching=False)
    expected = reference.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("arch", ["mistral_window", "qwen2_window", "gemma2", "gemma3", "gpt_oss"])
def test_prefix_hit_past_the_sliding_window_matches_transformers(arch, checkpoints, tokenizer):
    """Sliding-window layers keep every block, so a prompt that extends a cached one several
    windows long reuses the whole cached prefix and still matches transformers."""
    from tests.utils.checkpoints import TEST_WINDOW, load_hf_model
    from tests.utils.reference import hf_greedy

    prefix = _prompt(tokenizer, 48)
    assert len(prefix) > 4 * TEST_WINDOW
    second = prefix + tokenizer.encode(" What is the capital of France?")
    llm = LLM(checkpoints[arch], max_model_len=256, block_size=16)
    llm.generate([{"prompt_token_ids": prefix + [5]}], GREEDY, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48
    assert hit.outputs[0].token_ids == hf_greedy(load_hf_model(checkpoints[arch]), second, 8)[0]
