"""POST /v1/completions through the openai client: base model and every adapter, sync and
async, streaming and not, logprobs/echo shapes, several prompts, token-id prompts, n,
stop strings, seeds, and the legacy guided_choice granite-io sends."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.conftest import INVOCATION, INVOCATION_2
from tests.entrypoints.conftest import MODEL

PROMPT = "The quick brown fox jumps over the lazy dog."
# model name -> a prompt that activates it (aLoRAs need their invocation at the end)
MODEL_PROMPTS = {
    MODEL: PROMPT,
    "lora_qkv": PROMPT,
    "lora_all": PROMPT,
    "alora_certainty": PROMPT + INVOCATION,
    "alora_answerability": PROMPT + INVOCATION_2,
}
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_lists_base_and_adapters(client, adapters):
    models = {m.id: m for m in client.models.list().data}
    assert set(MODEL_PROMPTS) <= set(models)
    assert models[MODEL].parent is None and models[MODEL].max_model_len == 512
    for name in ("lora_qkv", "lora_all", "alora_certainty", "alora_answerability"):
        assert models[name].parent == MODEL and models[name].root == adapters[name]


@pytest.mark.parametrize("model", list(MODEL_PROMPTS))
def test_completion_stream_matches_whole(client, model):
    whole = client.completions.create(model=model, prompt=MODEL_PROMPTS[model], **GREEDY)
    choice = whole.choices[0]
    assert whole.model == model and choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=model, prompt=MODEL_PROMPTS[model], stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_adapters_change_the_output(client):
    texts = {m: client.completions.create(model=m, prompt=MODEL_PROMPTS[m], **GREEDY).choices[0].text
             for m in (MODEL, "lora_qkv", "lora_all")}
    assert len(set(texts.values())) == 3


def test_completion_async(server):
    async def run():
        client = server.async_client()
        whole = await client.completions.create(model="lora_all", prompt=PROMPT, **GREEDY)
        stream = await client.completions.create(model="lora_all", prompt=PROMPT, stream=True, **GREEDY)
        text = "".join([c.choices[0].text async for c in stream])
        return whole.choices[0].text, text

    whole, streamed = asyncio.run(run())
    assert whole == streamed


def test_logprobs_shape(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **GREEDY)
    choice = result.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4  # the sampled token plus the top 3
        assert max(top.values()) >= value - 1e-6  # greedy: nothing likelier than the choice


def test_logprobs_stream_offsets(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, logprobs=1, stream=True, **GREEDY))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    text = "".join(c.choices[0].text for c in chunks)
    assert "".join(tokens) == text and len(tokens) == 12
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(12)]


def test_echo_with_logprobs_scores_the_prompt(client):
    # granite-io's PRM processor: echo=True, logprobs=1, max_tokens=1
    result = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
                                       temperature=0.0)
    choice = result.choices[0]
    n_prompt = result.usage.prompt_tokens
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset[n_prompt] == len(PROMPT)


def test_several_prompts_and_n(client, tokenizer):
    result = client.completions.create(model=MODEL, prompt=[PROMPT, "one two three"], n=2, temperature=1.0,
                                       seed=3, max_tokens=5)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    single = client.completions.create(model=MODEL, prompt="one two three", n=2, temperature=1.0, seed=3,
                                       max_tokens=5)
    assert [c.text for c in result.choices[2:]] == [c.text for c in single.choices]
    assert result.usage.prompt_tokens == single.usage.prompt_tokens + len(tokenizer.encode(PROMPT))
    assert 4 <= result.usage.completion_tokens <= 20


def test_token_id_prompts_match_text(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY).choices[0].text
    both = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], **GREEDY)
    assert by_ids == by_text == both.choices[0].text and len(both.choices) == 2


def test_stop_string_and_seed(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    start = next(i for i in range(2, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].isalnum())
    stop = full[start:start + 2]
    end = full.index(stop)
    cut = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:end] and cut.stop_reason == stop
    kept = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], temperature=0.0, max_tokens=12,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:end + 2]
    sampled = [client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=7, max_tokens=8)
               .choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_guided_choice_on_an_alora(client):
    # granite-io's certainty request: the legacy guided_choice field on /v1/completions
    result = client.completions.create(
        model="alora_certainty", prompt=PROMPT + INVOCATION, max_tokens=4, temperature=0.0,
        extra_body={"guided_choice": [str(i) for i in range(10)]},
    )
    assert result.choices[0].text in [str(i) for i in range(10)]


def test_stream_several_prompts_echo_and_n(client):
    prompts = [PROMPT, "one two three"]
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, stream=True, **GREEDY))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert texts[0].startswith(PROMPT) and texts[3].startswith("one two three")


def test_stream_lines_survive_unicode_line_separators(server):
    # httpx's aiter_lines (and so many SDK wrappers) splits on everything str.splitlines() does;
    # text holding U+2028 / U+0085 must not cut a server-sent event in two (found by the soak).
    prompt = "one\u2028two\x85three\u2029four"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0.0, "stream": True}
    texts, events = [], 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                texts.append(json.loads(line[len("data: "):])["choices"][0]["text"])
            else:
                assert line == "" or line == "data: [DONE]", f"an event was split: {line!r}"
    assert events >= 2 and "".join(texts).startswith(prompt)
