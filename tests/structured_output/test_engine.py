"""Structured outputs through the whole engine: every schema kind clients send parses
and validates (even from a random-weight model), choice and regex hold, constrained
rows do not disturb unconstrained neighbours, and they work with LoRA/aLoRA, n > 1,
logprobs and stop conditions."""

import json
import re

import jsonschema
import pytest

from tests.conftest import INVOCATION
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.lora.request import LoRARequest

SCHEMAS = {
    "string_enum": {"type": "string", "enum": ["answerable", "unanswerable"]},
    "integer_enum": {"type": "integer", "enum": list(range(10))},
    "boolean": {"type": "boolean"},
    "object_enums": {
        "type": "object",
        "properties": {"context_relevance": {"type": "string", "enum": ["relevant", "irrelevant", "partial"]}},
        "required": ["context_relevance"],
    },
    "array_refs": {
        "$defs": {
            "Citation": {
                "type": "object",
                "properties": {"r": {"type": "integer", "minimum": 0}, "c": {"type": "integer", "minimum": 0}},
                "required": ["r", "c"],
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/Citation"},
        "maxItems": 2,
    },
}


@pytest.fixture(scope="module")
def so_llm(llama_dir):
    return LLM(llama_dir, max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8)


def _params(spec: StructuredOutputsParams, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 200)
    return SamplingParams(structured_outputs=spec, **kwargs)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schemas_parse_and_validate(so_llm, name):
    schema = SCHEMAS[name]
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = so_llm.generate(["Answer:", "What now?"], [_params(spec, temperature=0), _params(spec, temperature=1.0, seed=3)],
                           use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)


def test_choice_and_regex(so_llm):
    choice = _params(StructuredOutputsParams(choice=["yes", "no", "maybe"]), temperature=1.0, seed=1)
    regex = _params(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), temperature=1.0, seed=2)
    outs = so_llm.generate(["Q?", "Code:"], [choice, regex], use_tqdm=False)
    assert outs[0].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].outputs[0].text)


def test_unconstrained_neighbours_unchanged(so_llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = ["The quick brown fox", "What is the capital of France?"]
    alone = so_llm.generate(prompts, plain, use_tqdm=False)
    constrained = _params(StructuredOutputsParams(json=SCHEMAS["object_enums"]), temperature=0)
    mixed = so_llm.generate(prompts + ["Classify:", "Again:"], [plain, plain, constrained, constrained], use_tqdm=False)
    for a, m in zip(alone, mixed[:2]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        # Equal up to matmul rounding across batch sizes (the mask itself leaves
        # unconstrained rows bit-identical: tests/structured_output/test_bitmask.py).
        for lp_a, lp_m, t in zip(a.outputs[0].logprobs, m.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(lp_a[t].logprob - lp_m[t].logprob) < 1e-5


def test_with_alora_n_logprobs_and_stop(so_llm, adapters, tokenizer):
    alora = LoRARequest("alora_certainty", 1, adapters["alora_certainty"])
    ids = tokenizer.encode("Is Paris in France? Yes." + INVOCATION)
    spec = StructuredOutputsParams(json=SCHEMAS["integer_enum"])
    out = so_llm.generate([{"prompt_token_ids": ids}], _params(spec, n=3, temperature=1.0, seed=5, logprobs=3),
                          lora_request=alora, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert int(completion.text) in range(10)
        assert len(completion.logprobs) == len(completion.token_ids)
        # The mask removes disallowed tokens from the distribution the logprobs describe.
        assert all(lp[t].logprob > float("-inf") for lp, t in zip(completion.logprobs, completion.token_ids))
    # A stop string inside the constrained output ends it early.
    stopped = so_llm.generate(["List:"], _params(StructuredOutputsParams(regex=r"abc[0-9]{5}"), stop=["c"],
                                                 temperature=0), use_tqdm=False)[0].outputs[0]
    assert stopped.text == "ab" and stopped.finish_reason == "stop" and stopped.stop_reason == "c"
    # max_tokens caps a constrained output before the grammar completes.
    capped = so_llm.generate(["List:"], _params(StructuredOutputsParams(regex=r"[a-z]{50}"), max_tokens=3,
                                                temperature=0), use_tqdm=False)[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 3


@pytest.mark.parametrize("spec, match", [
    (dict(json={"type": "nonsense"}), "nonsense"),
    (dict(json="{not json"), "JSON"),
    (dict(regex="(unclosed"), "regex"),
    (dict(json={"$ref": "https://example.com/schema.json"}), r"\$ref"),
])
def test_invalid_specs_are_value_errors(so_llm, spec, match):
    with pytest.raises(ValueError, match=match):
        so_llm.generate(["x"], _params(StructuredOutputsParams(**spec)), use_tqdm=False)
    assert not so_llm.llm_engine.has_unfinished_requests()
