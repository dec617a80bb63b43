"""LoRA and aLoRA outputs equal PEFT's: greedy tokens identical, logprobs within 1e-4."""

import pytest

from tests.lora.conftest import check_against_reference, generate_one
from vllm import LLM, SamplingParams


@pytest.mark.parametrize("name", ["lora_qkv", "lora_all"])
def test_plain_lora_matches_peft(name, lora_llm, lora_requests, peft_reference, tokenizer):
    for text in ["What is the capital of France?", "one two three four five six seven eight " * 4]:
        ids = tokenizer.encode(text)
        check_against_reference(generate_one(lora_llm, ids, lora_requests[name]), peft_reference(name, ids))


def _conversation(tokenizer, n_tokens):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. What is the capital of France? " * 20)
    return ids[:n_tokens]


@pytest.mark.parametrize("name", ["alora_certainty", "alora_answerability"])
def test_alora_matches_peft(name, lora_llm, lora_requests, invocations, peft_reference, tokenizer):
    inv = invocations[name]
    conv = _conversation(tokenizer, 40)
    cases = {
        "once": conv + inv,
        "once_then_text": conv + inv + tokenizer.encode(" How sure?"),
        "twice_last_counts": conv[:10] + inv + conv[10:25] + inv + tokenizer.encode(" ok"),
        "at_block_boundary": _conversation(tokenizer, 32) + inv,  # invocation starts at 32 = 2 blocks
    }
    for case, ids in cases.items():
        out = generate_one(lora_llm, ids, lora_requests[name])
        check_against_reference(out, peft_reference(name, ids))


def test_alora_chunk_boundary_inside_invocation(llama_dir, lora_requests, invocations, peft_reference, tokenizer):
    inv = invocations["alora_certainty"]
    conv = _conversation(tokenizer, 21)
    ids = conv + inv + tokenizer.encode(" sure?")
    # A 24-token step budget ends the first chunk 3 tokens into the invocation.
    llm = LLM(llama_dir, max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_batched_tokens=24)
    assert len(conv) < 24 < len(conv) + len(inv)
    check_against_reference(generate_one(llm, ids, lora_requests["alora_certainty"]), peft_reference("alora_certainty", ids))


def test_alora_without_adapter_tokens_before_invocation_is_base(lora_llm, lora_requests, invocations, tokenizer):
    """Prompt logprobs before the invocation equal the base model's exactly."""
    inv = invocations["alora_certainty"]
    ids = _conversation(tokenizer, 30) + inv + tokenizer.encode(" hi")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    base = generate_one(lora_llm, ids, None, params).prompt_logprobs
    alora = generate_one(lora_llm, ids, lora_requests["alora_certainty"], params).prompt_logprobs
    start = 30
    for p in range(1, start + 1):  # logits at positions < start predict tokens 1..start
        assert base[p][ids[p]].logprob == alora[p][ids[p]].logprob
    assert any(base[p][ids[p]].logprob != alora[p][ids[p]].logprob for p in range(start + 1, len(ids)))


def test_rslora_regex_targets_and_bin_weights_match_peft(llama_dir, tmp_path, peft_reference, tokenizer):
    """use_rslora scaling, a regex target_modules, and weights stored as adapter_model.bin."""
    import torch
    from safetensors.torch import load_file

    from tests.utils.adapters import load_peft_model, make_adapter
    from tests.utils.reference import hf_greedy
    from vllm.lora.request import LoRARequest

    path = make_adapter(llama_dir, str(tmp_path / "rs"), r".*\.(q_proj|v_proj|down_proj)", r=4, lora_alpha=8,
                        seed=21, use_rslora=True)
    bin_path = tmp_path / "rs_bin"
    bin_path.mkdir()
    (bin_path / "adapter_config.json").write_text((tmp_path / "rs" / "adapter_config.json").read_text())
    torch.save(load_file(str(tmp_path / "rs" / "adapter_model.safetensors")), bin_path / "adapter_model.bin")
    llm = LLM(llama_dir, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    ids = tokenizer.encode("What is the capital of France? The capital")
    reference = hf_greedy(load_peft_model(llama_dir, path), ids, 10)
    for i, adapter in enumerate((path, str(bin_path))):
        check_against_reference(generate_one(llm, ids, LoRARequest(f"rs{i}", i + 1, adapter)), reference)
