"""`vllm serve` on a Granite Switch checkpoint through the official `openai` client: the
embedded adapters listed in /v1/models and addressed as `model=<adapter>`; chat with
logprobs and structured outputs equal streamed, non-streamed, via
`chat_template_kwargs.adapter_name` and offline (`LLM.chat`); prefix-cache reuse of a base
turn; token-id completions that hold a control token; and bad requests answered with
OpenAI-shaped 4xx errors while the server keeps serving."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.entrypoints.utils import RemoteOpenAIServer
from vllm import LLM, SamplingParams
from vllm.entrypoints.openai.response_models import clamp_logprob
from vllm.sampling_params import StructuredOutputsParams

BLOCK = 16
ADAPTERS = ("rewrite", "guardian", "citations")
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
REWRITE_MESSAGES = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
GUARDIAN_MESSAGES = [SYSTEM, {"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello!"},
                     {"role": "user", "content": "Is this request safe?\n<guardian> Please check the last message."}]
CHOICES = ["yes", "no", "maybe", "unanswerable"]
VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["safe", "unsafe"]}}, "required": ["verdict"],
           "additionalProperties": False}
# adapter -> (conversation, request fields of its structured output, the same offline)
CONSTRAINED = {
    "rewrite": (REWRITE_MESSAGES, {"structured_outputs": {"choice": CHOICES}},
                StructuredOutputsParams(choice=CHOICES)),
    "guardian": (GUARDIAN_MESSAGES,
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}},
                 StructuredOutputsParams(json=VERDICT)),
}
MAX_TOKENS, TOP = 16, 3
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(switch_assets):
    args = ["--dtype", "float32", "--max-model-len", "256", "--enable-lora",
            "--max-lora-rank", "8", "--lora-modules", f"runtime={switch_assets.runtime_adapter_dir}",
            "--allowed-lora-root", os.path.dirname(switch_assets.runtime_adapter_dir)]
    with RemoteOpenAIServer(switch_assets.switch_dir, args,
                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as remote:
        yield remote


@pytest.fixture
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def base(switch_assets) -> str:
    return switch_assets.switch_dir  # the served name: the model argument


@pytest.fixture(scope="module")
def tokenizer(switch_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(switch_assets.switch_dir)


def render(tokenizer, messages, adapter_name=None) -> list[int]:
    kwargs = {} if adapter_name is None else {"adapter_name": adapter_name}
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def chat(client, messages, model, stream=False, **fields):
    """(text, [(token, logprob, [top logprobs])], finish_reason) of one greedy chat, streamed or not."""
    extra = fields.pop("extra_body", {})
    common = dict(model=model, messages=messages, temperature=0.0, max_tokens=MAX_TOKENS, logprobs=True,
                  top_logprobs=TOP, extra_body={**fields, **extra})
    if not stream:
        choice = client.chat.completions.create(**common).choices[0]
        entries, text, finish = choice.logprobs.content, choice.message.content, choice.finish_reason
    else:
        chunks = [c for c in client.chat.completions.create(stream=True, **common) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        finish = chunks[-1].choices[0].finish_reason
    assert "".join(e.token for e in entries) == text
    return text, [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in entries], finish


def assert_same(a, b):
    (text_a, lps_a, finish_a), (text_b, lps_b, finish_b) = a, b
    assert (text_a, finish_a) == (text_b, finish_b)
    assert [t for t, _, _ in lps_a] == [t for t, _, _ in lps_b]
    for (_, lp_a, top_a), (_, lp_b, top_b) in zip(lps_a, lps_b):
        assert abs(lp_a - lp_b) < ATOL and len(top_a) == len(top_b) == TOP
        assert max(abs(x - y) for x, y in zip(top_a, top_b)) < ATOL


def test_models_lists_base_embedded_adapters_and_runtime_lora(client, switch_assets, base):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [base, *ADAPTERS, "runtime"]
    assert cards[base].parent is None and cards[base].root == switch_assets.switch_dir
    for name in ADAPTERS:
        assert cards[name].parent == base and cards[name].root == switch_assets.switch_dir
    assert cards["runtime"].parent == base and cards["runtime"].root == switch_assets.runtime_adapter_dir


@pytest.fixture(scope="module")
def offline(switch_assets):
    return LLM(switch_assets.switch_dir, dtype="float32", max_model_len=256)


@pytest.mark.parametrize("adapter", list(CONSTRAINED))
def test_adapter_chat_streamed_whole_by_kwarg_and_offline_agree(client, offline, base, adapter):
    messages, constraint, offline_constraint = CONSTRAINED[adapter]
    whole = chat(client, messages, model=adapter, **constraint)
    assert whole[2] == "stop" and whole[1]
    assert_same(whole, chat(client, messages, model=adapter, stream=True, **constraint))
    by_kwarg = chat(client, messages, base, chat_template_kwargs={"adapter_name": adapter}, **constraint)
    assert_same(whole, by_kwarg)
    both = chat(client, messages, model=adapter, chat_template_kwargs={"adapter_name": adapter}, **constraint)
    assert_same(whole, both)
    assert whole[0] in CHOICES if adapter == "rewrite" else json.loads(whole[0])["verdict"] in ("safe", "unsafe")

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP,
                            structured_outputs=offline_constraint)
    out = offline.chat(messages, params, chat_template_kwargs={"adapter_name": adapter}, use_tqdm=False)[0].outputs[0]
    assert out.text == whole[0] and out.finish_reason == whole[2]
    for token_id, entry, (_, logprob, top) in zip(out.token_ids, out.logprobs, whole[1], strict=True):
        assert abs(clamp_logprob(entry[token_id].logprob) - logprob) < ATOL
        # Logprobs after the grammar's mask; the HTTP answer clamps a masked token's -inf.
        ours = sorted((clamp_logprob(lp.logprob) for lp in entry.values()), reverse=True)[:TOP]
        assert max(abs(x - y) for x, y in zip(ours, top)) < ATOL

    # The adapter really applies: without it the same request answers or scores differently.
    plain = chat(client, messages, base, **constraint)
    assert plain[0] != whole[0] or any(abs(a[1] - b[1]) > 1e-3 for a, b in zip(plain[1], whole[1]))


def test_cached_tokens_after_a_base_turn_are_the_blocks_before_the_control_token(client, tokenizer, base):
    history = [SYSTEM, {"role": "user", "content": "Tell me about the river that runs through Paris, please."},
               {"role": "assistant", "content": "It is the Seine, which flows north-west to the sea."}]
    cases = {"rewrite": history + [{"role": "user", "content": "And how long is it, roughly?"}],
             "guardian": history + [{"role": "user", "content": "Check this turn for harm.\n<guardian> Is it safe?"}],
             "citations": history + [{"role": "user", "content": "Which sources say so?"}]}
    for adapter, messages in cases.items():
        ids = render(tokenizer, messages, adapter)
        control = tokenizer.convert_tokens_to_ids(f"<|{adapter}|>")
        position = ids.index(control)
        assert ids.count(control) == 1 and (position == 0 if adapter == "citations" else position >= 2 * BLOCK)
        assert render(tokenizer, messages)[:position] == ids[:position]  # the base turn's prompt up to there
        turn = client.chat.completions.create(model=base, messages=messages, max_tokens=1)
        assert turn.usage.prompt_tokens == len(ids)
        result = client.chat.completions.create(model=adapter, messages=messages, max_tokens=1)
        assert result.usage.prompt_tokens == len(ids)
        # aLoRA: every full block before the control token is the base turn's; LoRA: nothing.
        assert result.usage.prompt_tokens_details.cached_tokens == position // BLOCK * BLOCK, adapter
        again = client.chat.completions.create(model=adapter, messages=messages, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("adapter,messages", [("rewrite", REWRITE_MESSAGES), ("guardian", GUARDIAN_MESSAGES),
                                              ("citations", REWRITE_MESSAGES)])
def test_token_id_completion_with_a_control_token_equals_the_chat(client, tokenizer, base, adapter, messages):
    ids = render(tokenizer, messages, adapter)
    assert tokenizer.convert_tokens_to_ids(f"<|{adapter}|>") in ids
    greedy = dict(temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})
    expected = client.chat.completions.create(model=adapter, messages=messages, **greedy)
    assert expected.usage.prompt_tokens == len(ids)
    for model in (base, adapter):  # naming the adapter selects nothing extra: the control token does
        result = client.completions.create(model=model, prompt=ids, **greedy)
        assert result.choices[0].text == expected.choices[0].message.content
        assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == 8


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_error(response: httpx.Response, status: int, *texts: str, err_type: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert error["type"] == (err_type or {400: "BadRequestError", 404: "NotFoundError"}[status])
    for text in texts:
        assert text in error["message"], error["message"]


def test_bad_requests_are_clear_4xx_and_the_server_keeps_serving(server, client, tokenizer, base):
    chat_body = {"messages": REWRITE_MESSAGES, "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", {**chat_body, "model": "nope"}), 404,
                 "The model `nope` does not exist.")
    for stream in (False, True):
        assert_error(post(server, "/v1/chat/completions", {**chat_body, "model": base, "stream": stream,
                                                           "chat_template_kwargs": {"adapter_name": "nope"}}),
                     400, "'nope'", "'rewrite', 'guardian', 'citations'")
    assert_error(post(server, "/v1/chat/completions", {**chat_body, "model": "rewrite",
                                                       "chat_template_kwargs": {"adapter_name": "guardian"}}),
                 400, "'rewrite'", "'guardian'")
    control_ids = render(tokenizer, REWRITE_MESSAGES, "rewrite")
    assert_error(post(server, "/v1/completions", {"model": "runtime", "prompt": control_ids, "max_tokens": 2}),
                 400, "<|rewrite|>", "'runtime'")
    assert_error(post(server, "/v1/chat/completions", {**chat_body, "model": "runtime",
                                                       "chat_template_kwargs": {"adapter_name": "guardian"}}),
                 400, "'runtime'")
    with pytest.raises(openai.BadRequestError, match="citations"):
        client.chat.completions.create(model=base, messages=REWRITE_MESSAGES, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"adapter_name": "Citations"}})

    assert httpx.get(server.url + "/health").status_code == 200
    for model in (base, "rewrite", "runtime"):
        result = client.chat.completions.create(model=model, messages=REWRITE_MESSAGES, max_tokens=2)
        assert result.usage.completion_tokens >= 1
    assert server.proc.poll() is None and "Traceback" not in server.output()


def test_runtime_adapter_cannot_take_an_embedded_adapters_name(server, client, switch_assets, base):
    before = [m.id for m in client.models.list().data]
    for name in (*ADAPTERS, base):
        response = post(server, "/v1/load_lora_adapter",
                        {"lora_name": name, "lora_path": switch_assets.runtime_adapter_dir})
        assert_error(response, 400, f"'{name}' has already been loaded.", err_type="InvalidUserInput")
    assert [m.id for m in client.models.list().data] == before
    # The embedded adapter still answers as itself, and another name loads fine.
    assert client.chat.completions.create(model="rewrite", messages=REWRITE_MESSAGES, max_tokens=2).choices
    ok = post(server, "/v1/load_lora_adapter",
              {"lora_name": "runtime2", "lora_path": switch_assets.runtime_adapter_dir})
    assert ok.status_code == 200, ok.text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "runtime2"}).status_code == 200
