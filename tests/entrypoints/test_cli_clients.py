"""`vllm chat`, `vllm complete` and `vllm run-batch`, each run as the real command
(`python -m vllm.entrypoints.cli.main ...`) and checked against what the shared server
answers the `openai` client / a raw POST for the same greedy requests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import INVOCATION
from tests.entrypoints.conftest import MODEL
from tests.entrypoints.utils import REPO_ROOT, free_port
from vllm.entrypoints.cli.main import make_parser

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"
GREEDY_FLAGS = ["--temperature", "0", "--max-tokens", "8"]


def vllm(*args: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONIOENCODING": "utf-8",
           "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OPENAI_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *args], input=stdin, text=True,
                          capture_output=True, cwd=REPO_ROOT, env=env, timeout=timeout)


def chat_answer(client, messages, model=MODEL) -> str:
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_completion_tokens=8).choices[0].message.content


def test_help_lists_the_commands():
    result = vllm("--help")
    assert result.returncode == 0
    for command in ("serve", "chat", "complete", "run-batch"):
        assert command in result.stdout, command


def test_chat_quick_prints_the_servers_answer(server, client):
    result = vllm("chat", "--url", server.url + "/v1", "-q", QUESTION, *GREEDY_FLAGS)  # model: first listed
    assert result.returncode == 0, result.stderr
    answer = chat_answer(client, [{"role": "user", "content": QUESTION}])
    assert answer
    assert result.stdout == f"Using model: {MODEL}\n{answer}\n"


def test_complete_quick_with_an_adapter(server, client):
    result = vllm("complete", "--url", server.url + "/v1", "--model", "lora_qkv", "--quick", PROMPT, *GREEDY_FLAGS)
    assert result.returncode == 0, result.stderr
    text = client.completions.create(model="lora_qkv", prompt=PROMPT, temperature=0, max_tokens=8).choices[0].text
    assert text
    assert result.stdout == f"Using model: lora_qkv\n{text}\n"


def test_chat_interactive_keeps_the_conversation(server, client):
    lines = ["Hello!", "And then?"]
    result = vllm("chat", "--url", server.url + "/v1", "--model-name", MODEL, "--system-prompt", "Be brief.",
                  *GREEDY_FLAGS, stdin="".join(line + "\n" for line in lines))
    assert result.returncode == 0, result.stderr
    conversation = [{"role": "system", "content": "Be brief."}]
    answers = []
    for line in lines:
        conversation.append({"role": "user", "content": line})
        answers.append(chat_answer(client, conversation))
        conversation.append({"role": "assistant", "content": answers[-1]})
    assert result.stdout == ("Using model: tiny-llama\nPlease enter a message for the chat model:\n"
                             + "".join(f"> {answer}\n" for answer in answers) + "> \n")


def test_client_errors_are_one_line_messages(server):
    unknown = vllm("chat", "--url", server.url + "/v1", "--model", "nope", "-q", "hi")
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("vllm chat: error: 404") and "does not exist" in unknown.stderr
    session = vllm("chat", "--url", server.url + "/v1", "--model", "nope", stdin="hi\nagain\n")
    assert session.returncode == 0  # an interactive session reports each failed turn and goes on
    assert session.stderr.count("vllm chat: error: 404") == 2 and session.stdout.endswith("> > > \n")
    refused = vllm("complete", "--url", f"http://127.0.0.1:{free_port()}/v1", "-q", "hi")
    assert refused.returncode == 1 and "could not connect" in refused.stderr and "Traceback" not in refused.stderr


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
ASK = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
# custom_id -> (url, body, expected status); the server answers each body the same way
REQUESTS = {
    "chat-base": (CHAT_URL, {"model": MODEL, "messages": ASK, **GREEDY}, 200),
    "completion-lora": (COMPLETIONS_URL, {"model": "lora_all", "prompt": [PROMPT, "Hello"], **GREEDY}, 200),
    "chat-alora": (CHAT_URL, {"model": "alora_certainty", "messages": ASK + [{"role": "certainty", "content": ""}],
                              **GREEDY}, 200),
    "completion-alora": (COMPLETIONS_URL, {"model": "alora_certainty", "prompt": PROMPT + INVOCATION, **GREEDY}, 200),
    "alora-without-invocation": (CHAT_URL, {"model": "alora_certainty", "messages": ASK, **GREEDY}, 400),
    "bad-body": (CHAT_URL, {"model": MODEL, "messages": ASK, "temperature": "hot"}, 400),
    "unknown-model": (COMPLETIONS_URL, {"model": "nope", "prompt": PROMPT}, 404),
}
if importlib.util.find_spec("vllm.entrypoints.openai.serving_responses") is not None:  # the route is optional
    REQUESTS["responses-lora"] = ("/v1/responses", {"model": "lora_qkv", "input": QUESTION, "temperature": 0,
                                                    "max_output_tokens": 8}, 200)


def _comparable(body: dict) -> dict:
    """A response without what differs between two runs of one request (ids, time, cache hits)."""
    body = {k: v for k, v in body.items() if k not in ("id", "created", "created_at")}
    if body.get("output"):  # /v1/responses: output items have ids too
        body["output"] = [{k: v for k, v in item.items() if k != "id"} for item in body["output"]]
    if body.get("usage"):  # chat/completions and /v1/responses name the cache hits differently
        body["usage"] = {k: v for k, v in body["usage"].items()
                         if k not in ("prompt_tokens_details", "input_tokens_details")}
    return body


def test_run_batch_matches_the_server(llama_dir, server_args, server, tmp_path):
    lines = [_line(cid, url, body) for cid, (url, body, _) in REQUESTS.items()]
    lines[2:2] = ["{not json", "", _line("embed", "/v1/embeddings", {"input": "x"}),
                  _line("get", CHAT_URL, REQUESTS["chat-base"][1], method="GET")]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = vllm("run-batch", "-i", str(source), "-o", str(target), "--model", llama_dir, *server_args)
    assert result.returncode == 0, result.stdout + result.stderr
    outputs = [json.loads(line) for line in target.read_text().splitlines()]

    expected_ids = [*list(REQUESTS)[:2], None, "embed", "get", *list(REQUESTS)[2:]]  # the blank line is skipped
    assert [o["custom_id"] for o in outputs] == expected_ids
    assert len({o["id"] for o in outputs}) == len(outputs)
    assert all(o["id"].startswith("vllm-") and o["response"]["request_id"].startswith("vllm-batch-")
               for o in outputs)
    by_id = {o["custom_id"]: o for o in outputs}
    for custom_id, (url, body, status) in REQUESTS.items():
        output, answer = by_id[custom_id], httpx.post(server.url + url, json=body, timeout=120)
        assert answer.status_code == status and output["response"]["status_code"] == status, custom_id
        if status == 200:
            assert output["error"] is None
            assert _comparable(output["response"]["body"]) == _comparable(answer.json()), custom_id
        else:
            assert output["response"]["body"] is None
            assert output["error"] == answer.json(), custom_id  # the server's error body, message and all
    assert by_id["completion-lora"]["response"]["body"]["usage"]["completion_tokens"] == 16
    for custom_id, text in ((None, "Line 3 is not valid JSON"), ("embed", "/v1/embeddings"), ("get", "POST")):
        output = by_id[custom_id]
        assert output["response"]["status_code"] == 400 and output["response"]["body"] is None
        assert text in output["error"]["error"]["message"] and output["error"]["error"]["code"] == 400


def test_run_batch_empty_input_and_refusals(llama_dir, tmp_path, capsys):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n")
    parser = make_parser()
    args = parser.parse_args(["run-batch", "-i", str(source), "-o", str(target), "--model", llama_dir,
                              "--max-model-len", "64"])
    args.dispatch(args)
    assert target.read_text() == ""
    for flags, message in ((["-i", "https://example.com/in.jsonl", "-o", str(target)], "is a URL"),
                           (["-i", str(source), "-o", "s3://bucket/out.jsonl"], "is a URL"),
                           (["-i", str(tmp_path / "missing.jsonl"), "-o", str(target)], "cannot read"),
                           (["-i", str(source), "-o", str(source)], "must differ")):
        args = parser.parse_args(["run-batch", *flags, "--model", llama_dir])
        with pytest.raises(SystemExit) as exit_info:
            args.dispatch(args)
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("vllm run-batch: error:") and message in err, err
