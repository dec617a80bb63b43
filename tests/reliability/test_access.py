"""Who may call the server and what it reads. With an API key every route needs it except
/health, /ping, /version and /metrics: the routes are enumerated from the app itself, so a
route added later is covered. Request bodies above `--max-request-body-bytes` get 413, with
or without Content-Length. Runtime adapter loads read only under `--allowed-lora-root`
(symlinks and `..` resolved) and are refused without it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from types import SimpleNamespace

import httpx
import pytest

from tests.entrypoints.utils import RemoteOpenAIServer
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.api_server import create_app, run_server
from vllm.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES
from vllm.entrypoints.openai.errors import BadRequestError
from vllm.entrypoints.openai.guards import OPEN_PATHS
from vllm.entrypoints.openai.lifecycle import DrainState
from vllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest
from vllm.entrypoints.openai.serving_models import OpenAIServingModels

KEY = "sk-reliability"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
LIMIT = "64K"  # 65536 bytes
RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory, adapters) -> str:
    """A root holding one adapter, a symlink out of it, and nothing else."""
    root = tmp_path_factory.mktemp("lora_root")
    shutil.copytree(adapters["lora_qkv"], root / "inside")
    os.symlink(adapters["lora_all"], root / "escape")
    return str(root)


def _server_args(lora_root: str) -> list[str]:
    return ["--served-model-name", MODEL, "--max-model-len", "128", "--api-key", KEY, "--enable-lora",
            "--max-lora-rank", "8", "--max-request-body-bytes", LIMIT, "--allowed-lora-root", lora_root]


@pytest.fixture(scope="module")
def server(llama_dir, lora_root):
    with RemoteOpenAIServer(llama_dir, _server_args(lora_root), env=RUNTIME_LORA, api_key=KEY) as remote:
        yield remote
    # close() sent SIGTERM: an idle server with the default --shutdown-timeout 0 exits cleanly.
    assert remote.proc.returncode == 0


def _routes(lora_root: str, monkeypatch, *extra: str) -> set[tuple[str, str]]:
    """(method, path) of every route the server's app has, built with the server's flags."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    args = make_parser().parse_args(["serve", "m", *_server_args(lora_root), *extra])
    app = create_app(args, [KEY], DrainState())
    return {(method, path) for methods, path in _flatten(app.routes) for method in methods - {"HEAD"}}


def _flatten(routes) -> list[tuple[set[str], str]]:
    """(methods, path) of routes, descending into included routers (FastAPI >= 0.165 keeps them
    as one object); an unknown kind of route fails the test rather than being skipped."""
    found = []
    for route in routes:
        if hasattr(route, "effective_route_contexts"):
            found += [(set(context.methods), context.path) for context in route.effective_route_contexts()]
        else:
            assert hasattr(route, "methods"), f"unknown route {route!r}: teach this test about it"
            found.append((set(route.methods), route.path))
    return found


def test_every_route_but_the_probes_needs_the_key(server, lora_root, monkeypatch):
    routes = _routes(lora_root, monkeypatch)
    paths = {path for _, path in routes}
    # The enumeration sees the routes this test is about (a sanity check of the enumeration).
    assert {"/tokenize", "/detokenize", "/reset_prefix_cache", "/docs", "/redoc", "/openapi.json",
            "/v1/load_lora_adapter", "/v1/completions"} <= paths and OPEN_PATHS <= paths
    for method, path in sorted(routes):
        body = {} if method == "POST" else None
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.request(method, server.url + path, json=body, headers=headers)
            if path in OPEN_PATHS:
                assert response.status_code == 200, (method, path, response.text)
            else:
                assert response.status_code == 401, (method, path, headers)
                error = response.json()["error"]
                assert error["code"] == 401 and "--api-key" in error["message"]
        keyed = httpx.request(method, server.url + path, json=body, headers=AUTH)
        assert keyed.status_code not in (401, 404, 405, 500), (method, path, keyed.text)
    openapi = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    assert "/v1/chat/completions" in openapi["paths"]


def test_disable_fastapi_docs_removes_the_docs(lora_root, monkeypatch):
    paths = {path for _, path in _routes(lora_root, monkeypatch, "--disable-fastapi-docs")}
    assert not paths & {"/docs", "/redoc", "/openapi.json"} and "/v1/completions" in paths


def test_body_size_flag():
    parser = make_parser()
    assert parser.parse_args(["serve", "m"]).max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES == 32 * 2**20
    assert parser.parse_args(["serve", "m", "--max-request-body-bytes", "1m"]).max_request_body_bytes == 10**6
    for bad in ("0", "-5", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", "--max-request-body-bytes", bad])


def _completion(padding: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "x" * padding}).encode()


def test_bodies_over_the_limit_get_413(server):
    url = server.url + "/v1/completions"
    headers = {**AUTH, "Content-Type": "application/json"}
    fits = httpx.post(url, content=_completion(60_000), headers=headers)
    assert fits.status_code == 200, fits.text

    declared = httpx.post(url, content=_completion(70_000), headers=headers)  # Content-Length
    assert declared.status_code == 413
    error = declared.json()["error"]
    assert error["code"] == 413 and "65536" in error["message"] and "--max-request-body-bytes" in error["message"]

    big = _completion(200_000)
    chunked = httpx.post(url, content=(big[i:i + 8192] for i in range(0, len(big), 8192)), headers=headers)
    assert chunked.request.headers.get("transfer-encoding") == "chunked"
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == 413

    small = _completion(10)
    chunked_fits = httpx.post(url, content=iter([small[:5], small[5:]]), headers=headers)
    assert chunked_fits.status_code == 200, chunked_fits.text
    assert httpx.get(server.url + "/health").status_code == 200


def _load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      headers=AUTH)


def test_runtime_loads_read_only_under_the_allowed_root(server, lora_root, adapters):
    inside = _load(server, "inside", os.path.join(lora_root, "inside"))
    assert inside.status_code == 200, inside.text
    completion = httpx.post(server.url + "/v1/completions", headers=AUTH,
                            json={"model": "inside", "prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200, completion.text

    outside = adapters["lora_all"]
    dotdot = os.path.join(lora_root, "inside", "..", "..", os.path.relpath(outside, os.path.dirname(lora_root)))
    for name, path in (("escape", os.path.join(lora_root, "escape")), ("dotdot", dotdot), ("direct", outside)):
        assert os.path.isdir(path)  # a real adapter: only the root keeps it out
        refused = _load(server, name, path)
        assert refused.status_code == 400, (name, refused.text)
        error = refused.json()["error"]
        assert "--allowed-lora-root" in error["message"] and error["param"] == "lora_path"
        assert f"'{name}'" in error["message"]
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert {m["id"] for m in models} == {MODEL, "inside"}


def test_runtime_loads_are_refused_without_a_root():
    engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace()))
    models = OpenAIServingModels(engine, MODEL, "/model", 128)
    with pytest.raises(BadRequestError, match="start the server with --allowed-lora-root") as info:
        asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="a", lora_path="/tmp")))
    assert info.value.param == "lora_path"


def test_a_missing_root_stops_start_up(tmp_path):
    args = make_parser().parse_args(["serve", "m", "--allowed-lora-root", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--allowed-lora-root .* is not an existing folder"):
        asyncio.run(run_server(args))  # refused before the model is loaded
