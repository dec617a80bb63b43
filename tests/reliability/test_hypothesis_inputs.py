"""Hostile input offline, property-based (hypothesis): whatever a caller passes either works
or is a ValueError with a message, never another exception, and the engine keeps serving.

- `SamplingParams(**random kwargs)`: constructs or raises ValueError.
- Prompts through `LLM.generate` (empty, huge, lone surrogates, control characters, bytes,
  token ids outside the vocabulary, mixtures): generate or raise ValueError.
- Adapters (a real PEFT adapter with its adapter_config.json fields and weight tensors
  perturbed) loaded through a `LoRARequest`: serve or raise ValueError naming the adapter.

One engine for the module; examples are few (each is an engine call) and have no deadline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from tests.conftest import INVOCATION
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

MAX_MODEL_LEN = 64
_FAST = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def fast(max_examples: int) -> settings:
    return settings(_FAST, max_examples=max_examples)

# ------------------------------------------------------------------ SamplingParams
_INTERNAL = {"all_stop_token_ids", "eos_token_id", "bad_words_token_ids"}
FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.name not in _INTERNAL]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
)
keys = st.one_of(st.text(max_size=3), st.integers())
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(keys, scalars, max_size=3))


@fast(300)
@given(st.dictionaries(st.sampled_from(FIELDS), values, max_size=4))
def test_sampling_params_construct_or_value_error(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert str(e)
        return
    try:  # a constructed one also survives the engine's vocab check, or says which field is out of it
        params.verify_against_vocab(1024)
    except ValueError as e:
        assert "outside the vocabulary [0, 1024)" in str(e)


# ------------------------------------------------------------------ prompts through the engine
@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=MAX_MODEL_LEN, enable_lora=True, enable_activated_lora=True,
               max_lora_rank=16, max_loras=2, max_cpu_loras=2)


GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
control = st.characters(max_codepoint=0x1F)
texts = st.one_of(
    st.text(max_size=40), st.text(control, max_size=10), st.text(surrogates, min_size=1, max_size=3),
    st.builds(lambda a, b: a + b, st.text(max_size=10), st.text(surrogates, min_size=1, max_size=2)),
    st.integers(min_value=1, max_value=200).map(lambda n: "word " * n),  # over max_model_len at the top
)
token_ids = st.lists(st.integers(min_value=-(2**40), max_value=2**40) | st.integers(0, 1100), max_size=80)
prompts = st.one_of(
    texts, token_ids.map(lambda ids: {"prompt_token_ids": ids}), texts.map(lambda t: {"prompt": t}),
    st.binary(max_size=10), st.builds(lambda t, ids: {"prompt": t, "prompt_token_ids": ids}, texts, token_ids),
    st.lists(st.one_of(texts, st.integers()), max_size=3), st.none(), st.integers(),
)


@fast(40)
@given(prompts)
def test_prompts_generate_or_value_error(llm, prompt):
    try:
        outputs = llm.generate(prompt, GREEDY, use_tqdm=False)
    except ValueError as e:
        assert str(e)
        return
    assert outputs or prompt == []  # an empty batch has no outputs
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)


def test_engine_serves_after_hostile_prompts(llm):
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.generate("a\ud800b", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.chat([{"role": "user", "content": "\udfff"}], GREEDY, use_tqdm=False)
    [output] = llm.generate("hello there", GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2


# ------------------------------------------------------------------ adapters
@pytest.fixture(scope="module")
def source_adapter(adapters) -> str:
    """An aLoRA on all linear layers (r=8): the config and tensors every example perturbs."""
    return adapters["alora_certainty"]


config_changes = st.fixed_dictionaries({}, optional={
    "r": st.one_of(st.integers(-2, 40), st.none(), st.text(max_size=2), st.floats(allow_nan=True)),
    "lora_alpha": st.one_of(st.integers(-4, 64), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2)),
    "target_modules": st.one_of(st.none(), st.just([]), st.lists(st.sampled_from(
        ["q_proj", "v_proj", "down_proj", "lm_head", "nope", ""]), max_size=3), st.just(".*proj"), st.integers()),
    "alora_invocation_tokens": st.one_of(st.none(), st.just([]), st.lists(st.integers(-5, 2000), max_size=4),
                                         st.text(max_size=3)),
    "use_rslora": st.one_of(st.booleans(), st.text(max_size=2)),
    "rank_pattern": st.one_of(st.just({}), st.dictionaries(st.sampled_from(["q_proj", "(", "v"]),
                                                           st.integers(-1, 16), max_size=2), st.text(max_size=2)),
})
tensor_changes = st.lists(st.sampled_from(["drop", "extra", "transpose", "widen", "nan"]), max_size=2)


def _perturb(source: str, target: str, changes: dict, edits: list[str]) -> None:
    shutil.copytree(source, target)
    config_path = os.path.join(target, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)
    weights_path = os.path.join(target, "adapter_model.safetensors")
    tensors = load_file(weights_path)
    name = sorted(tensors)[0]
    for edit in edits:
        if edit == "drop" and name in tensors:
            del tensors[name]
        elif edit == "extra":
            tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight"] = torch.zeros(2, 2)
        elif edit == "transpose" and name in tensors:
            tensors[name] = tensors[name].t().contiguous()
        elif edit == "widen" and name in tensors:
            tensors[name] = torch.cat([tensors[name], tensors[name]], dim=0)
        elif edit == "nan" and name in tensors:
            tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, weights_path)


_ids = iter(range(1000, 10**6))


@fast(25)
@given(config_changes, tensor_changes)
def test_adapter_configs_load_or_value_error(llm, source_adapter, tmp_path_factory, changes, edits):
    path = str(tmp_path_factory.mktemp("perturbed") / "adapter")
    _perturb(source_adapter, path, changes, edits)
    name = f"perturbed-{next(_ids)}"
    prompt = "Is it true? " + INVOCATION  # holds the source aLoRA's invocation
    try:
        [output] = llm.generate(prompt, GREEDY, lora_request=LoRARequest(name, next(_ids), path), use_tqdm=False)
    except ValueError as e:
        assert name in str(e) or "invocation" in str(e), str(e)
        return
    assert len(output.outputs[0].token_ids) >= 1
    [plain] = llm.generate("hello there", GREEDY, use_tqdm=False)  # the engine still serves
    assert len(plain.outputs[0].token_ids) == 2
