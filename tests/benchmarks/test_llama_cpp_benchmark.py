"""benchmarks/against_llama_cpp.py: the GGUF files it writes (quantized linears, an 8-bit head), the greedy
check's prompt and prefix count, the engine side timed on a tiny file, and the whole comparison
where llama-cpp-python is installed (it is not an engine dependency: CI skips that part)."""

from __future__ import annotations

import copy

import gguf
import pytest

from benchmarks import against_llama_cpp as bench
from benchmarks.common import load_hf_config


@pytest.mark.parametrize("linear_type, head_type", [("Q4_0", "Q8_0"), ("Q8_0", "Q8_0"), ("BF16", "BF16")])
def test_file_holds_the_linears_in_their_type_and_the_head_in_8_bits(linear_type, head_type, llama_dir, tmp_path):
    path = bench.write_file(llama_dir, linear_type, str(tmp_path))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == types.get("output.weight", head_type) == head_type
    layers = {kind for name, kind in types.items() if name.startswith("blk.") and not name.endswith("norm.weight")}
    assert layers == {linear_type}


def test_agreeing_prefix_counts_leading_equal_tokens():
    assert bench.agreeing_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert bench.agreeing_prefix([1, 2], [1, 2, 3]) == 2
    assert bench.agreeing_prefix([], [1]) == 0


def test_check_prompt_is_the_chat_request_where_the_tokenizer_has_a_template(tokenizer):
    ids = bench.check_prompt(tokenizer, len(tokenizer))
    assert "lighthouse keeper" in tokenizer.decode(ids)
    without = copy.deepcopy(tokenizer)
    without.chat_template = None
    ids = bench.check_prompt(without, len(without))
    assert len(ids) == 64 and "lighthouse" not in without.decode(ids)


def test_engine_side_decodes_and_times_a_gguf_file(llama_dir, tmp_path):
    path = bench.write_file(llama_dir, "Q8_0", str(tmp_path))
    engine = bench.Engine(path, threads=1, n_ctx=128)
    prompt = list(range(10, 40))
    assert len(engine.greedy(prompt, 5)) == 5
    assert 0 < engine.step_seconds(prompt, 4) < 10
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_llama_cpp_runs_the_same_tiny_file_and_agrees(llama_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    path = bench.write_file(llama_dir, "BF16", str(tmp_path))
    prompt = list(range(10, 40))
    theirs = bench.LlamaCpp(path, threads=1, n_ctx=128)
    assert 0 < theirs.step_seconds(prompt, 4) < 10
    # A BF16 file: both compute with the same 16-bit weights (the engine in bf16 or fp32, llama.cpp
    # in fp32); the tiny model's first greedy tokens must agree.
    ours = bench.Engine(path, threads=1, n_ctx=128)
    vocab = load_hf_config(llama_dir).vocab_size
    assert all(0 <= t < vocab for t in theirs.greedy(prompt, 4))
    assert bench.agreeing_prefix(ours.greedy(prompt, 4), theirs.greedy(prompt, 4)) >= 1
