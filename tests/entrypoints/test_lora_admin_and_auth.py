"""Runtime adapter loading (/v1/load_lora_adapter, /v1/unload_lora_adapter) with vLLM's
request bodies and texts, and API-key enforcement on /v1 routes (a second server started
with --api-key and without VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import INVOCATION
from tests.entrypoints.conftest import MODEL
from tests.entrypoints.utils import RemoteOpenAIServer

KEY = "sk-test-key"


def test_load_use_and_unload_adapter(server, client, adapters):
    url = server.url
    load = httpx.post(url + "/v1/load_lora_adapter",
                      json={"lora_name": "certainty_alora", "lora_path": adapters["alora_certainty"]})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'certainty_alora' added successfully."
    models = {m.id: m for m in client.models.list().data}
    assert models["certainty_alora"].parent == MODEL and models["certainty_alora"].root == adapters["alora_certainty"]
    result = client.completions.create(model="certainty_alora", prompt="Is it true?" + INVOCATION, max_tokens=3,
                                       temperature=0.0)
    preloaded = client.completions.create(model="alora_certainty", prompt="Is it true?" + INVOCATION, max_tokens=3,
                                          temperature=0.0)
    assert result.choices[0].text == preloaded.choices[0].text  # same weights, another name

    # mellea accepts 200 or a 400 whose body contains "has already been loaded."
    again = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "certainty_alora", "lora_path": adapters["alora_certainty"]})
    assert again.status_code == 400
    assert "The lora adapter 'certainty_alora' has already been loaded." in again.text
    preloaded_again = httpx.post(url + "/v1/load_lora_adapter",
                                 json={"lora_name": "lora_qkv", "lora_path": adapters["lora_qkv"]})
    assert preloaded_again.status_code == 400 and "has already been loaded." in preloaded_again.text

    unload = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "certainty_alora"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'certainty_alora' removed successfully."
    assert "certainty_alora" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="certainty_alora", prompt="x" + INVOCATION, max_tokens=1)
    # a reload gets a fresh lora_int_id and works again
    reload = httpx.post(url + "/v1/load_lora_adapter",
                        json={"lora_name": "certainty_alora", "lora_path": adapters["alora_certainty"]})
    assert reload.status_code == 200
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "certainty_alora"}).status_code == 200


def test_adapter_endpoint_errors(server, tmp_path):
    url = server.url
    unknown = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "never_loaded"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The lora adapter 'never_loaded' cannot be found."
    missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    bad_path = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad_path.status_code == 400 and "'x'" in bad_path.json()["error"]["message"]
    assert "x" not in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert httpx.get(url + "/health").status_code == 200


@pytest.fixture(scope="module")
def keyed_server(llama_dir):
    with RemoteOpenAIServer(llama_dir, ["--max-model-len", "128", "--api-key", KEY],
                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False"}, api_key=KEY) as remote:
        yield remote


def test_api_key_guards_v1_routes(keyed_server):
    url = keyed_server.url
    model = keyed_server.client().models.list().data[0].id
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path, payload in (("GET", "/v1/models", None), ("POST", "/v1/completions", body),
                                      ("POST", "/v1/chat/completions", {"model": model, "messages": []})):
            response = httpx.request(method, url + path, json=payload, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    for path in ("/health", "/ping", "/version", "/metrics"):  # open, as in vLLM
        assert httpx.get(url + path).status_code == 200


def test_runtime_lora_routes_absent_without_env(keyed_server, adapters):
    response = httpx.post(keyed_server.url + "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {KEY}"},
                          json={"lora_name": "a", "lora_path": adapters["lora_qkv"]})
    assert response.status_code == 404


def test_load_inplace_replaces_weights_under_the_same_name(server, client, adapters):
    url, prompt = server.url, "one two three four five"
    greedy = dict(prompt=prompt, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    as_qkv = client.completions.create(model="lora_qkv", **greedy).choices[0].text
    as_all = client.completions.create(model="lora_all", **greedy).choices[0].text
    assert as_qkv != as_all
    assert httpx.post(url + "/v1/load_lora_adapter",
                      json={"lora_name": "swappable", "lora_path": adapters["lora_qkv"]}).status_code == 200
    assert client.completions.create(model="swappable", **greedy).choices[0].text == as_qkv
    swap = httpx.post(url + "/v1/load_lora_adapter",
                      json={"lora_name": "swappable", "lora_path": adapters["lora_all"], "load_inplace": True})
    assert swap.status_code == 200
    assert client.completions.create(model="swappable", **greedy).choices[0].text == as_all
    assert [m.id for m in client.models.list().data].count("swappable") == 1
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "swappable"}).status_code == 200
