"""The aLoRA training example, examples/alora/train_alora.py, end to end on the default
model: a reduced run's adapter loads and serves as an aLoRA; the fully trained sentiment
intrinsic, invoked after a real base turn, answers exactly one of its labels, mostly the
right one, on the base turn's KV cache, and token for token as PEFT does.

All run on the real SmolLM2-135M-Instruct, hence `slow` (slow tests run in CI).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from tests.utils.adapters import load_peft_model
from tests.utils.reference import hf_greedy, hf_prompt_logprobs
from vllm import LLM, SamplingParams
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.model_executor.default_model import ensure_default_model

_EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "alora", "train_alora.py")
_spec = importlib.util.spec_from_file_location("train_alora", _EXAMPLE)
train_alora = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_alora)

# Written by hand, unlike the templated training data: other topics, other words.
HELD_OUT = [
    ("We finally went to the beach house this weekend and the sunsets were breathtaking. "
     "The kids loved every minute.", "positive"),
    ("My sister's wedding was beautiful, the food was delicious and everyone danced all night.", "positive"),
    ("I passed my driving test on the first try! The instructor said I was a natural.", "positive"),
    ("The recipe you suggested turned out so tasty that my family asked for seconds.", "positive"),
    ("The flight was delayed six hours, they lost my suitcase and nobody at the desk would help.", "negative"),
    ("My landlord still hasn't fixed the heating and it's freezing in here. I'm so fed up.", "negative"),
    ("The printer jammed again and ate my report right before the meeting. What a nightmare.", "negative"),
    ("I waited an hour for the pizza and it arrived cold and soggy.", "negative"),
]
BLOCK_SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Run this module on one thread. On a 2-core machine shared with other jobs, two torch
    threads that spin waiting for each other made the full training 7x slower (514 s against
    70 s), and on an idle one they were no faster (2.3 s against 2.2 s a step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return ensure_default_model()


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=1024, block_size=BLOCK_SIZE, enable_lora=True, enable_activated_lora=True,
               max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def trained_adapter(model_dir, tmp_path_factory) -> tuple[str, dict]:
    """(folder, summary) of the sentiment aLoRA trained with the example's defaults."""
    out = str(tmp_path_factory.mktemp("sentiment_alora"))
    return out, train_alora.train(out, seed=0, model=model_dir)


@pytest.mark.slow
def test_reduced_training_run_saves_an_alora_that_serves(llm, model_dir, tmp_path):
    out = str(tmp_path / "adapter")
    summary = train_alora.main(["--output-dir", out, "--steps", "3", "--batch-size", "2", "--model", model_dir])
    assert summary["final_loss"] > 0

    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    tokenizer = llm.get_tokenizer()
    invocation = tokenizer.encode(train_alora.INVOCATION, add_special_tokens=False)
    assert config["alora_invocation_tokens"] == invocation == [1, 14812, 2572, 198]
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    assert PEFTHelper.from_dir("reduced", out).is_alora

    lora = LoRARequest("reduced", 1, out)
    conversation = [{"role": "user", "content": "I loved the concert last night!"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    result = llm.chat(conversation + [train_alora.INTRINSIC_TURN], params, lora_request=lora, use_tqdm=False)[0]
    assert len(result.outputs[0].token_ids) > 0
    # The empty sentiment turn renders the invocation, then the generation prompt.
    rendered = tokenizer.decode(result.prompt_token_ids)
    assert rendered.endswith(train_alora.INVOCATION + "<|im_end|>\n<|im_start|>assistant\n")

    with pytest.raises(ValueError, match="reduced.*sentiment"):
        llm.chat(conversation, params, lora_request=lora, use_tqdm=False)


def _base_turns(llm) -> list:
    params = SamplingParams(temperature=0, max_tokens=40)
    return llm.chat([[{"role": "user", "content": text}] for text, _ in HELD_OUT], params, use_tqdm=False)


@pytest.mark.slow
def test_trained_intrinsic_answers_in_format_on_the_base_turns_cache(llm, trained_adapter):
    path, summary = trained_adapter
    assert summary["final_loss"] < 0.05
    base = _base_turns(llm)
    for out in base:  # the base model is untouched: it answers in prose
        assert out.outputs[0].text.strip() not in train_alora.LABELS and len(out.outputs[0].text) > 20

    conversations = [[{"role": "user", "content": text}, {"role": "assistant", "content": out.outputs[0].text},
                      train_alora.INTRINSIC_TURN] for (text, _), out in zip(HELD_OUT, base)]
    sentiment = LoRARequest("sentiment", 2, path)
    results = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=8), lora_request=sentiment,
                       use_tqdm=False)

    answers = [r.outputs[0].text for r in results]
    assert all(answer in train_alora.LABELS for answer in answers), answers
    assert all(r.outputs[0].finish_reason == "stop" for r in results)  # ended by <|im_end|>
    right = sum(answer == label for answer, (_, label) in zip(answers, HELD_OUT))
    assert right >= len(HELD_OUT) - 1, answers
    for intrinsic, turn in zip(results, base):
        # Every full block of the base turn's prompt (system and user message) came from
        # the base model's cache.
        assert intrinsic.num_cached_tokens >= len(turn.prompt_token_ids) // BLOCK_SIZE * BLOCK_SIZE > BLOCK_SIZE


@pytest.mark.slow
def test_trained_intrinsic_matches_peft(llm, model_dir, trained_adapter):
    path, _ = trained_adapter
    peft_model = load_peft_model(model_dir, path)
    tokenizer = llm.get_tokenizer()
    sentiment = LoRARequest("sentiment", 2, path)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    for text, _ in (HELD_OUT[0], HELD_OUT[-1]):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode(train_alora.sentiment_prompt(tokenizer, messages), add_special_tokens=False)
        out = llm.generate([{"prompt_token_ids": ids}], params, lora_request=sentiment, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 2 and out.token_ids[1] == tokenizer.eos_token_id
        ours = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        # hf_greedy never picks EOS, so it checks the label; PEFT's logprob of the
        # engine's EOS right after checks the end of the answer.
        label, label_logprob = hf_greedy(peft_model, ids, 1)
        eos_logprob = hf_prompt_logprobs(peft_model, ids + out.token_ids)[-1]
        assert out.token_ids[:1] == label
        assert abs(ours[0] - label_logprob[0]) < 1e-4 and abs(ours[1] - eos_logprob) < 1e-4
