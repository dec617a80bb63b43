"""Adapter lifecycle: unloading an adapter that requests are using, reusing an adapter's name or
lora_int_id for other weights, and the host adapter cache's bound.

- Unload "waits for" running requests: they finish with the weights they were admitted with
  (same tokens as undisturbed), while a new request naming the adapter gets a 404 (HTTP).
- Prefix-cache keys and LoRA slots follow the adapter's weights (`LoRAModel.fingerprint`), not
  its id: an id reused for other weights never hits the old blocks or reads the old slot, even
  while a request with the old weights still runs; aLoRA base blocks stay shared with the base.
- `AdapterCache` never holds more than max_cpu_loras adapters; evicted ones reload on demand
  with the same outputs.
"""

from __future__ import annotations

import types
from typing import Optional

import httpx
import pytest

from tests.conftest import INVOCATION
from tests.core.test_scheduler import BS, make_request, make_scheduler, run_step
from tests.entrypoints.utils import RemoteOpenAIServer
from tests.utils.adapters import ALL_LINEAR, make_adapter
from vllm import LLM, SamplingParams
from vllm.core.kv_cache_utils import make_block_hasher
from vllm.core.request import Request
from vllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"


def adapter_request(req_id: str, prompt: list[int], lora: LoRARequest, fingerprint: bytes, max_tokens: int = 4,
                    alora_start: Optional[int] = None) -> Request:
    """A scheduler-level request carrying (stand-in) admitted weights with this fingerprint."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_tokenizer(eos_token_id=0, generation_eos_ids=set())
    return Request(req_id, prompt, params, max_tokens=max_tokens, lora_request=lora,
                   lora_weights=types.SimpleNamespace(fingerprint=fingerprint), alora_invocation_start=alora_start,
                   block_hasher=make_block_hasher(BS))


# ------------------------------------------------------------------ pure Python: keys and scheduling
def test_block_keys_follow_the_weights_not_the_id():
    a1, a2 = LoRARequest("a", 1, "/a"), LoRARequest("a", 2, "/a")
    prompt = list(range(1, 13))
    old = adapter_request("old", prompt, a1, b"old weights")
    new = adapter_request("new", prompt, a1, b"new weights")
    same = adapter_request("same", prompt, a2, b"old weights")
    base = make_request("base", prompt)
    assert len(old.block_hashes) == len(base.block_hashes) == 3
    assert not set(old.block_hashes) & set(new.block_hashes)  # same id, other weights: nothing shared
    assert same.block_hashes == old.block_hashes  # other id, same weights: the same KV
    assert not set(base.block_hashes) & set(old.block_hashes)
    # aLoRA: blocks before the invocation start are the base model's; after it, where the adapter
    # starts is part of the key (KV after it depends on it).
    alora = [adapter_request(f"s{s}", prompt, a1, b"old weights", alora_start=s) for s in (4, 5, 6)]
    assert alora[0].block_hashes[0] == base.block_hashes[0]
    assert alora[1].block_hashes[:1] == base.block_hashes[:1] and alora[1].block_hashes[1] != alora[2].block_hashes[1]


def test_an_id_with_two_sets_of_weights_never_shares_a_step():
    sched = make_scheduler(max_loras=2)
    lora = LoRARequest("a", 1, "/a")
    old = adapter_request("old", [1, 2, 3, 4, 5], lora, b"old weights", max_tokens=6)
    new = adapter_request("new", [1, 2, 3, 4, 5], lora, b"new weights", max_tokens=3)
    new2 = adapter_request("new2", [6, 7, 8], lora, b"new weights", max_tokens=3)
    sched.add_request(old)
    run_step(sched)
    sched.add_request(new)
    sched.add_request(new2)
    finished = []
    while sched.has_unfinished_requests():
        out, outputs = run_step(sched)
        newer = {req_id for req_id in out.num_scheduled_tokens if req_id != "old"}
        assert not ("old" in out.num_scheduled_tokens and newer), out.num_scheduled_tokens
        finished += [o.request_id for o in outputs if o.finished]
    assert finished[0] == "old" and set(finished) == {"old", "new", "new2"}


# ----------------------------------------------------------------------------- offline engines
@pytest.fixture(scope="module")
def other_weights(tmp_path_factory, llama_dir, tokenizer) -> dict[str, str]:
    """A LoRA and an aLoRA with the test adapters' shapes and invocation but other weights."""
    root = tmp_path_factory.mktemp("lifecycle")
    invocation = tokenizer.encode(INVOCATION, add_special_tokens=False)
    return {"lora": make_adapter(llama_dir, str(root / "lora"), ALL_LINEAR, r=8, seed=21),
            "alora": make_adapter(llama_dir, str(root / "alora"), ALL_LINEAR, r=8, seed=22,
                                  invocation_tokens=invocation)}


def make_llm(llama_dir, **kwargs) -> LLM:
    return LLM(llama_dir, max_model_len=128, block_size=4, enable_lora=True, max_lora_rank=8,
               enable_prefix_caching=True, **kwargs)


def generate(llm: LLM, prompt: str, lora: LoRARequest):
    return llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]


@pytest.mark.parametrize("kind", ["lora", "alora"])
def test_reused_id_never_hits_the_old_weights_blocks(llama_dir, adapters, other_weights, kind):
    first = adapters["lora_all"] if kind == "lora" else adapters["alora_certainty"]
    prompt = PROMPT + (INVOCATION if kind == "alora" else "")
    expected = generate(make_llm(llama_dir), prompt, LoRARequest("a", 1, other_weights[kind]))
    llm = make_llm(llama_dir)
    llm.generate(prompt, GREEDY, use_tqdm=False)  # fills the cache with the base blocks
    before = generate(llm, prompt, LoRARequest("a", 1, first))
    assert generate(llm, prompt, LoRARequest("a", 1, first)).num_cached_tokens > 0  # the cache works
    llm.llm_engine.remove_lora(1)
    after = generate(llm, prompt, LoRARequest("a", 1, other_weights[kind]))
    assert after.outputs[0].token_ids == expected.outputs[0].token_ids != before.outputs[0].token_ids
    # Only base blocks (before an aLoRA's invocation) may be reused; a plain LoRA reuses nothing.
    alora_start = len(llm.get_tokenizer().encode(PROMPT)) if kind == "alora" else 0
    assert after.num_cached_tokens == alora_start // 4 * 4


def test_reused_id_while_the_old_weights_still_run(llama_dir, adapters, other_weights, tokenizer):
    """remove_lora(1) and a new adapter under id 1 while a request with the old id-1 weights is
    running: each request computes with its own weights to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = tokenizer.encode(PROMPT)
    reference = make_llm(llama_dir)
    old_expected = generate(reference, PROMPT, LoRARequest("a", 1, adapters["lora_all"])).outputs[0].token_ids
    new_expected = generate(reference, PROMPT, LoRARequest("b", 2, other_weights["lora"])).outputs[0].token_ids
    engine = make_llm(llama_dir, max_loras=1).llm_engine
    engine.add_request("old", {"prompt_token_ids": ids}, params, lora_request=LoRARequest("a", 1, adapters["lora_all"]))
    engine.step()
    engine.step()
    engine.remove_lora(1)
    engine.add_request("new", {"prompt_token_ids": ids}, params,
                       lora_request=LoRARequest("a", 1, other_weights["lora"]))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert finished["old"][:12] == old_expected and finished["new"][:12] == new_expected


def test_host_cache_stays_within_max_cpu_loras(llama_dir, adapters):
    llm = make_llm(llama_dir, max_loras=1, max_cpu_loras=2)
    cache = llm.llm_engine.engine_core.lora_adapters
    names = ["lora_qkv", "lora_all", "alora_certainty", "alora_answerability"]
    prompts = {"alora_certainty": PROMPT + INVOCATION,
               "alora_answerability": PROMPT + "<|start_of_role|>answerability<|end_of_role|>"}
    first = {}
    for i, name in enumerate(names, start=1):
        first[name] = generate(llm, prompts.get(name, PROMPT), LoRARequest(name, i, adapters[name]))
        assert len(cache) <= 2
    assert 1 not in cache  # evicted: least recently used
    again = generate(llm, PROMPT, LoRARequest("lora_qkv", 1, adapters["lora_qkv"]))  # reloads from its path
    assert again.outputs[0].token_ids == first["lora_qkv"].outputs[0].token_ids
    assert again.num_cached_tokens > 0  # same weights, same fingerprint: its blocks are still valid
    assert len(cache) == 2 and 1 in cache


# --------------------------------------------------------------------------------------- HTTP
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def lora_server(llama_dir, tmp_path_factory):
    args = ["--served-model-name", MODEL, "--max-model-len", "256", "--enable-lora", "--max-lora-rank", "8",
            "--max-loras", "2", "--allowed-lora-root", str(tmp_path_factory.getbasetemp())]
    with RemoteOpenAIServer(llama_dir, args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:
        yield server


def _load(server, name: str, path: str) -> None:
    response = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert response.status_code == 200, response.text


def _complete(server, model: str, max_tokens: int = 24) -> str:
    return server.client().completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                              extra_body={"ignore_eos": True}).choices[0].text


def test_unload_waits_for_running_requests_over_http(lora_server, adapters, other_weights):
    _load(lora_server, "x", adapters["lora_all"])
    expected = _complete(lora_server, "x", max_tokens=128)
    stream = lora_server.client().completions.create(model="x", prompt=PROMPT, max_tokens=128, temperature=0.0,
                                                     stream=True, extra_body={"ignore_eos": True})
    chunks, after_unload, finish = [], 0, None
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if len(chunks) == 1:
            unload = httpx.post(lora_server.url + "/v1/unload_lora_adapter", json={"lora_name": "x"})
            assert unload.status_code == 200, unload.text
        else:
            after_unload += 1
    # 128 engine steps: the unload (answered between two steps) lands mid-generation, and the
    # stream goes on after it.
    assert after_unload > 0
    assert "".join(chunks) == expected and finish == "length"
    gone = httpx.post(lora_server.url + "/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    # The name reused for other weights (the server gives it a new id) computes with those.
    _load(lora_server, "y", other_weights["lora"])
    reference = _complete(lora_server, "y")
    _load(lora_server, "x", other_weights["lora"])
    assert _complete(lora_server, "x") == reference != expected[: len(reference)]
