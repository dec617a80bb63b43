"""The model's generation_config.json as default sampling parameters (`--generation-config`,
`--override-generation-config`), offline and over HTTP: they fill only what a request
leaves unset."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.entrypoints.utils import RemoteOpenAIServer
from tests.utils.logs import logged_messages
from vllm import LLM, SamplingParams
from vllm.engine.llm_engine import _producible_stop_ids
from vllm.sampling_defaults import load_sampling_defaults

CREATOR = {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "max_new_tokens": 7, "do_sample": True, "num_beams": 1}


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen_defaults") / "model"
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **CREATOR}))
    return str(path)


def test_defaults_from_the_model_folder_a_folder_or_none(model_dir, llama_dir):
    assert load_sampling_defaults(model_dir) == {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "max_tokens": 7}
    assert load_sampling_defaults(llama_dir, generation_config=model_dir)["max_tokens"] == 7
    assert load_sampling_defaults(model_dir, generation_config="vllm") == {}
    assert load_sampling_defaults(model_dir, overrides={"temperature": 0.5})["temperature"] == 0.5


@pytest.mark.parametrize("overrides, message", [
    ({"do_sample": True}, "unsupported keys"),
    ({"temperature": -1.0}, "Invalid default sampling parameters"),
])
def test_bad_overrides_are_refused(model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_sampling_defaults(model_dir, overrides=overrides)
    with pytest.raises(ValueError, match="must be 'auto', 'vllm' or a folder"):
        load_sampling_defaults(model_dir, generation_config="/no/such/folder")


def test_offline_defaults_apply_when_sampling_params_are_omitted(model_dir, tokenizer):
    llm = LLM(model_dir, max_model_len=128)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 7)  # greedy: top_k / top_p do not apply
    ids = tokenizer.encode("What is the capital of France?")
    out = llm.generate([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs[0]
    greedy = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=7),
                          use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 7 and out.token_ids == greedy.token_ids
    plain = LLM(model_dir, max_model_len=128, generation_config="vllm",
                override_generation_config='{"max_new_tokens": 3}')
    assert plain.get_default_sampling_params().temperature == 1.0
    assert plain.get_default_sampling_params().max_tokens == 3


def test_server_fills_only_unset_fields(model_dir):
    args = ["--max-model-len", "128", "--override-generation-config", '{"max_new_tokens": 5}']
    with RemoteOpenAIServer(model_dir, args) as server:
        client = server.client()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        a = client.chat.completions.create(model=model_dir, messages=messages)  # temperature 0 from the model
        b = client.chat.completions.create(model=model_dir, messages=messages)
        assert a.usage.completion_tokens <= 5 and a.choices[0].message.content == b.choices[0].message.content
        c = client.chat.completions.create(model=model_dir, messages=messages, max_tokens=9, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert c.usage.completion_tokens == 9  # explicit fields win
        completion = client.completions.create(model=model_dir, prompt="one two", max_tokens=None,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 5


def test_eos_ids_past_the_vocabulary_are_dropped_with_a_warning(llama_dir, tokenizer, tmp_path):
    """A generation config may list EOS ids the model's vocabulary lacks (a larger sibling's, a
    tokenizer's appended EOS): they can never be sampled, so the engine warns and starts; where no
    EOS id is left in the vocabulary it refuses with a message naming them."""
    path = tmp_path / "model"
    shutil.copytree(llama_dir, path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [tokenizer.eos_token_id,
                                                                                        vocab + 5]}))
    with logged_messages("vllm") as messages:
        llm = LLM(str(path), max_model_len=64)
    assert llm.llm_engine.eos_token_ids == {tokenizer.eos_token_id}
    assert any(f"[{vocab + 5}] lie outside the model's vocabulary of {vocab}" in m for m in messages)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    with pytest.raises(ValueError, match=rf"none of the EOS token ids \[{vocab}, {vocab + 5}\] .* \[0, {vocab}\)"):
        _producible_stop_ids({vocab, vocab + 5}, vocab)
