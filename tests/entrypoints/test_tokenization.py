"""POST /tokenize (prompt and chat forms), /detokenize and /reset_prefix_cache on the shared
server; `LLM.reset_prefix_cache()` offline."""

from __future__ import annotations

import httpx

from tests.entrypoints.conftest import MAX_MODEL_LEN, MODEL
from vllm import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_tokenize_prompt_and_detokenize_round_trip(server, tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    body = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                      "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenize_chat_gives_the_ids_a_chat_completion_sends(server, client):
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": QUESTION}).json()["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert len(ids) == chat.usage.prompt_tokens
    no_prompt = httpx.post(server.url + "/tokenize", json={"messages": QUESTION, "add_generation_prompt": False})
    assert no_prompt.json()["count"] < len(ids)


def test_tokenization_errors_are_openai_shaped(server):
    missing = httpx.post(server.url + "/tokenize", json={"model": "nope", "prompt": "hi"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    bad = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad.status_code == 400 and "Token ids must be in" in bad.json()["error"]["message"]
    invalid = httpx.post(server.url + "/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert invalid.status_code == 400
    both = httpx.post(server.url + "/tokenize", json={"messages": QUESTION, "add_generation_prompt": True,
                                                      "continue_final_message": True})
    assert both.status_code == 400


def test_reset_prefix_cache_route(server, client):
    prompt = "one two three four five six seven eight nine ten " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    after = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert after.usage.prompt_tokens_details.cached_tokens == 0


def test_llm_reset_prefix_cache(llama_dir, tokenizer):
    llm = LLM(llama_dir, max_model_len=128)
    ids = tokenizer.encode("one two three four five six seven eight nine ten " * 3)
    params = SamplingParams(max_tokens=1)
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].num_cached_tokens == 0
