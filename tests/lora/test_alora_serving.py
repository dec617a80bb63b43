"""aLoRA in the engine: mixed batches, KV reuse of the base model's cache, more
adapters than slots, and errors that leave the engine serving."""

import json
import os
import shutil

import pytest

from tests.conftest import INVOCATION
from tests.lora.conftest import GREEDY, generate_one
from tests.utils.adapters import ALL_LINEAR, make_adapter
from vllm import LLM
from vllm.lora.request import LoRARequest


def _conversation(tokenizer, n_tokens):
    ids = tokenizer.encode("Please answer the question using the documents provided. Paris is in France. " * 20)
    return ids[:n_tokens]


def test_mixed_batch_equals_solo_runs(lora_llm, lora_requests, invocations, tokenizer):
    conv = _conversation(tokenizer, 37)
    jobs = [
        (conv, None),
        (conv, lora_requests["lora_all"]),
        (conv + invocations["alora_certainty"], lora_requests["alora_certainty"]),
        (conv[:20] + invocations["alora_answerability"] + conv[20:30], lora_requests["alora_answerability"]),
        (conv[5:], None),
        (conv[3:] + invocations["alora_certainty"], lora_requests["alora_certainty"]),
    ]
    solo = []
    for ids, lora in jobs:
        lora_llm.llm_engine.engine_core.reset_prefix_cache()
        solo.append(generate_one(lora_llm, ids, lora).outputs[0].token_ids)
    batch = lora_llm.generate([{"prompt_token_ids": ids} for ids, _ in jobs], GREEDY,
                              lora_request=[lora for _, lora in jobs], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == solo
    # The plain LoRA really is adapted in the mixed batch (not masked off).
    assert solo[1] != solo[0]


def test_kv_reuse_from_base_model(llama_dir, lora_requests, invocations, tokenizer):
    llm = LLM(llama_dir, max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=16)
    no_cache = LLM(llama_dir, max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8,
                   enable_prefix_caching=False)
    conv = _conversation(tokenizer, 70)  # more than 4 blocks
    generate_one(llm, conv)  # the base model's turn fills the cache
    certainty = lora_requests["alora_certainty"]
    ids = conv + invocations["alora_certainty"]
    out = generate_one(llm, ids, certainty)
    assert out.num_cached_tokens == (70 // 16) * 16 == 64
    assert out.outputs[0].token_ids == generate_one(no_cache, ids, certainty).outputs[0].token_ids
    assert llm.llm_engine.get_stats().alora_reused_tokens == 64

    # A plain LoRA on the same conversation reuses nothing of the base blocks.
    plain = generate_one(llm, conv + tokenizer.encode(" more"), lora_requests["lora_all"])
    assert plain.num_cached_tokens == 0

    # Another aLoRA shares the same base blocks.
    other = generate_one(llm, conv + invocations["alora_answerability"], lora_requests["alora_answerability"])
    assert other.num_cached_tokens == 64


def test_more_adapters_than_slots(llama_dir, adapters, tmp_path_factory, invocations, tokenizer):
    root = tmp_path_factory.mktemp("many")
    paths = [make_adapter(llama_dir, str(root / f"a{i}"), ALL_LINEAR, r=4, seed=100 + i,
                          invocation_tokens=invocations["alora_certainty"] if i % 2 else None) for i in range(5)]
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    conv = _conversation(tokenizer, 25)
    prompts = [conv + (invocations["alora_certainty"] if i % 2 else []) for i in range(5)]
    big = LLM(llama_dir, max_model_len=256, enable_lora=True, max_loras=5, max_lora_rank=8)
    expected = [generate_one(big, p, r).outputs[0].token_ids for p, r in zip(prompts, requests)]
    small = LLM(llama_dir, max_model_len=256, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts] * 2, GREEDY, lora_request=requests * 2,
                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected * 2
    assert len(set(map(tuple, expected))) == 5


def _broken_copy(src, dst, edit_config=None, weights_bytes=None):
    shutil.copytree(src, dst)
    if edit_config:
        path = os.path.join(dst, "adapter_config.json")
        config = json.load(open(path))
        edit_config(config)
        json.dump(config, open(path, "w"))
    if weights_bytes is not None:
        open(os.path.join(dst, "adapter_model.safetensors"), "wb").write(weights_bytes)
    return str(dst)


def test_bad_adapters_are_clear_errors(lora_llm, adapters, checkpoints, tmp_path, tokenizer):
    src = adapters["lora_all"]
    cases = {
        "missing": (str(tmp_path / "nope"), "does not exist"),
        "corrupt": (_broken_copy(src, tmp_path / "corrupt", weights_bytes=b"not safetensors"), "cannot read its weights"),
        "dora": (_broken_copy(src, tmp_path / "dora", lambda c: c.update(use_dora=True)), "DoRA"),
        "modules_to_save": (_broken_copy(src, tmp_path / "mts", lambda c: c.update(modules_to_save=["lm_head"])),
                            "modules_to_save"),
        "rank": (make_adapter(checkpoints["llama"], str(tmp_path / "rank16"), ALL_LINEAR, r=16), "max_lora_rank"),
        "shapes": (make_adapter(checkpoints["qwen3"], str(tmp_path / "qwen3"), ["q_proj"], r=4), "does not fit"),
        "embedding": (make_adapter(checkpoints["llama"], str(tmp_path / "emb"), ["embed_tokens", "q_proj"], r=4),
                      "only lora_A / lora_B of linear layers"),
        "lm_head": (make_adapter(checkpoints["llama"], str(tmp_path / "head"), ["lm_head"], r=4), "lm_head"),
    }
    for i, (name, (path, match)) in enumerate(cases.items()):
        request = LoRARequest(f"bad_{name}", 100 + i, path)
        with pytest.raises(ValueError, match=match) as err:
            generate_one(lora_llm, tokenizer.encode("hello"), request)
        assert f"bad_{name}" in str(err.value)
    ids = tokenizer.encode("no invocation here")
    with pytest.raises(ValueError, match="alora_certainty") as err:
        generate_one(lora_llm, ids, LoRARequest("alora_certainty", 3, adapters["alora_certainty"]))
    assert INVOCATION in str(err.value)
    out = generate_one(lora_llm, ids, LoRARequest("lora_all", 2, adapters["lora_all"]))
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert not lora_llm.llm_engine.has_unfinished_requests()


def test_legacy_invocation_string(lora_llm, adapters, lora_requests, invocations, tmp_path, tokenizer):
    def to_legacy(config):
        config.pop("alora_invocation_tokens")
        config["invocation_string"] = INVOCATION

    legacy = _broken_copy(adapters["alora_certainty"], tmp_path / "legacy", to_legacy)
    ids = _conversation(tokenizer, 20) + invocations["alora_certainty"]
    expected = generate_one(lora_llm, ids, lora_requests["alora_certainty"]).outputs[0].token_ids
    assert generate_one(lora_llm, ids, LoRARequest("legacy", 50, legacy)).outputs[0].token_ids == expected


def test_chat_with_alora(lora_llm, lora_requests):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "certainty", "content": ""},
    ]
    # The certainty role renders <|start_of_role|>certainty<|end_of_role|>: the invocation.
    out = lora_llm.chat(messages, GREEDY, lora_request=lora_requests["alora_certainty"], use_tqdm=False,
                        add_generation_prompt=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
