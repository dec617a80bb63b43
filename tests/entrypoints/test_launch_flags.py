"""vLLM's launch surface: `python -m vllm.entrypoints.openai.api_server`, served-name aliases,
several API keys, TLS, request logging, `--config FILE.yaml`, `--hf-overrides`,
`--max-logprobs`, CORS off unless asked for, human-readable sizes, parallel sizes of 1.
Each flag is exercised by starting a real server with it."""

from __future__ import annotations

import argparse
import ssl
import subprocess
import sys

import httpx
import openai
import pytest

from tests.entrypoints.utils import REPO_ROOT, RemoteOpenAIServer
from vllm import LLM
from vllm.engine.arg_utils import human_readable_int
from vllm.entrypoints.cli.main import make_parser

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "serve.yaml"
    path.write_text("max_num_seqs: 4\nenable_prefix_caching: false\nmax_model_len: 256\nenable_log_requests: true\n")
    return str(path)


@pytest.fixture(scope="module")
def server(llama_dir, config_file):
    args = ["--config", config_file, "--served-model-name", "primary", "alias", "--api-key", "key-one", "key-two",
            "--max-model-len", "0.375K", "--max-logprobs", "3", "--max-log-len", "12", "--hf-overrides",
            '{"max_position_embeddings": 384}', "--tokenizer-revision", "main", "--download-dir", "/tmp/unused",
            "--hf-token", "unused", "-tp", "1", "--pipeline-parallel-size", "1", "--uvicorn-log-level", "warning"]
    with RemoteOpenAIServer(llama_dir, args, api_key="key-two", api_server_module=True) as remote:
        yield remote


def test_api_server_module_serves_aliases_with_any_key(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["primary", "alias"]
    response = client.chat.completions.create(model="alias", messages=MESSAGES, max_tokens=4)
    assert response.model == "primary"
    other = openai.OpenAI(base_url=server.url + "/v1", api_key="key-one", max_retries=0)
    assert other.completions.create(model="primary", prompt="hello", max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer key-three"}).status_code == 401


def test_config_file_and_human_readable_sizes_apply(server):
    client = server.client()
    # "0.375K" (384) on the command line wins over the file's max_model_len: 256.
    assert client.models.list().data[0].max_model_len == 384
    with pytest.raises(openai.BadRequestError, match=r"max_num_seqs \(4\)"):  # from the file
        client.completions.create(model="primary", prompt="hello", max_tokens=2, n=5)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    for _ in range(2):  # enable_prefix_caching: false in the file: nothing is reused
        usage = client.completions.create(model="primary", prompt=prompt, max_tokens=1).usage
        assert usage.prompt_tokens_details.cached_tokens == 0
    assert "Received request" in server.output()  # enable_log_requests: true in the file


def test_request_log_is_truncated_to_max_log_len(server):
    server.client().completions.create(model="primary", prompt="abcdefghijklmnopqrstuvwxyz", max_tokens=1)
    lines = [line for line in server.output().splitlines() if "abcdefghijkl" in line]
    assert lines and all("abcdefghijklm" not in line for line in lines)


def test_max_logprobs_is_enforced(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 3"):
        client.completions.create(model="primary", prompt="hello", max_tokens=2, logprobs=5)
    ok = client.completions.create(model="primary", prompt="hello", max_tokens=2, logprobs=3)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) >= 3


def test_cors_is_off_by_default_and_on_when_asked(server, llama_dir):
    preflight = {"Origin": "http://example.test", "Access-Control-Request-Method": "POST"}
    plain = httpx.get(server.url + "/health", headers={"Origin": "http://example.test"})
    assert "access-control-allow-origin" not in plain.headers
    assert "access-control-allow-origin" not in httpx.options(server.url + "/v1/models", headers=preflight).headers
    with RemoteOpenAIServer(llama_dir, ["--max-model-len", "128", "--allowed-origins", '["http://example.test"]'],
                            api_server_module=True) as remote:
        answer = httpx.options(remote.url + "/v1/models", headers=preflight)
        assert answer.headers.get("access-control-allow-origin") == "http://example.test"


def test_tls_with_ssl_keyfile_and_certfile(llama_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    args = ["--max-model-len", "128", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    with RemoteOpenAIServer(llama_dir, args, verify=ssl.create_default_context(cafile=str(cert))) as remote:
        assert remote.url.startswith("https://")
        client = openai.OpenAI(base_url=remote.url + "/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))))
        assert client.completions.create(model=llama_dir, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_parallel_sizes_that_cannot_work_are_a_clear_error(llama_dir):
    result = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", llama_dir, "-tp", "3"],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 1
    assert "tensor_parallel_size=3 must divide the number of attention heads (4)" in result.stderr
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLM(llama_dir, data_parallel_size=2)


def test_hf_overrides_offline(llama_dir):
    llm = LLM(llama_dir, hf_overrides={"max_position_embeddings": 96})
    assert llm.llm_engine.model_config.max_model_len == 96


@pytest.mark.parametrize("text, value", [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1.5M", 1572864),
                                         ("2g", 2 * 10**9)])
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["", "k", "1.5", "12x", "0.1k1"])
def test_human_readable_int_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_config_file_flags_lose_to_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_num_seqs: 4\nport: 9000\nenable_prefix_caching: false\nlora_modules: [a=/x, b=/y]\n")
    args = make_parser().parse_args(["serve", "m", "--config", str(path), "--port", "8001"])
    assert (args.max_num_seqs, args.port, args.enable_prefix_caching) == (4, 8001, False)
    assert [m.name for m in args.lora_modules] == ["a", "b"]
    path.write_text("no_such_flag: 1\n")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "m", "--config", str(path)])
