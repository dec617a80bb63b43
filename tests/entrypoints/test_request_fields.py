"""Request fields vLLM honours beyond OpenAI's: truncate_prompt_tokens, chat echo, bad_words,
request_id, return_tokens_as_token_ids and stream_options.continuous_usage_stats."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.conftest import MODEL
from vllm import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer):
    ids = tokenizer.encode("one two three four five six seven eight nine ten eleven twelve")
    full = client.completions.create(model=MODEL, prompt=ids[-5:], **GREEDY)
    cut = client.completions.create(model=MODEL, prompt=ids, temperature=0.0, max_tokens=8,
                                    extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5})
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == full.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"truncate_prompt_tokens": 0})


def test_chat_echo_prepends_the_continued_message(client):
    messages = QUESTION + [{"role": "assistant", "content": "The capital"}]
    kwargs = dict(model=MODEL, messages=messages, temperature=0.0, max_tokens=6,
                  extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True,
                              "ignore_eos": True})
    plain_kwargs = {**kwargs, "extra_body": {**kwargs["extra_body"], "echo": False}}
    plain = client.chat.completions.create(**plain_kwargs).choices[0].message.content
    echoed = client.chat.completions.create(**kwargs).choices[0].message.content
    assert echoed == "The capital" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == echoed


def test_bad_words_never_appear(llama_dir, tokenizer):
    llm = LLM(llama_dir, max_model_len=128)
    ids = tokenizer.encode("What is the capital of France? The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0].outputs[0]
    # A generated token that is a whole word by itself: banning the word bans that token.
    token = next(t for t in first.token_ids if tokenizer.decode([t]).strip().isalpha()
                 and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    word = tokenizer.decode([token]).strip()
    banned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])
    out = llm.generate([{"prompt_token_ids": ids}], banned, use_tqdm=False)[0].outputs[0]
    assert token not in out.token_ids and out.token_ids != first.token_ids
    sequences = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    for seq in sequences:
        assert all(out.token_ids[i:i + len(seq)] != seq for i in range(len(out.token_ids)))
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(bad_words=[" "]), use_tqdm=False)


def test_bad_words_over_http(client):
    plain = client.completions.create(model=MODEL, prompt="one two three", **GREEDY).choices[0].text
    word = plain.split()[0] if plain.split() else plain
    out = client.completions.create(model=MODEL, prompt="one two three", temperature=0.0, max_tokens=8,
                                    extra_body={"ignore_eos": True, "bad_words": [word]}).choices[0].text
    assert out != plain


def test_request_id_names_the_response(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                          extra_body={"request_id": "abc-123"})
    assert chat.id == "chatcmpl-abc-123"
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"request_id": "x9"})
    assert completion.id == "cmpl-x9"


def test_return_tokens_as_token_ids(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, logprobs=True, top_logprobs=2,
                                          temperature=0.0, max_tokens=8,
                                          extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    entries = chat.choices[0].logprobs.content
    assert entries and all(e.token.startswith("token_id:") for e in entries)
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
    completion = client.completions.create(model=MODEL, prompt="hi", logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
                                           temperature=0.0, max_tokens=4)
    logprobs = completion.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in logprobs.tokens)
    assert all(k.startswith("token_id:") for top in logprobs.top_logprobs for k in top)


def test_continuous_usage_stats(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True, stream_options=options,
                                                 **GREEDY))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1].usage.completion_tokens == 8
    completion = list(client.completions.create(model=MODEL, prompt="hi", stream=True, stream_options=options,
                                                **GREEDY))
    assert all(c.usage is not None for c in completion)
