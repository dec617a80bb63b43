"""Sanity checks of the Granite Switch oracle assets (tests/granite_switch/oracle/).

Checks the composed checkpoint's shape and ids against its tokenizer, the chat
template placements, the routing rule "adapter of the last control token at or
before p; 0 if none; <|base_reset|> -> 0" in granite-switch's HF model, and that
with no control token the Switch model decodes like transformers' own
GraniteForCausalLM on the base (system transformers, not the oracle venv's).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.granite_switch.oracle_env import Assets, reference, render_batch

MAX_TOKENS = 6


def expected_routing(ids: list[int], control_to_index: dict[int, int]) -> list[int]:
    current, out = 0, []
    for t in ids:
        current = control_to_index.get(t, current)
        out.append(current)
    return out


def mixed_prompt(assets: Assets) -> list[int]:
    """Base prompt with guardian, citations and base_reset control tokens spliced in."""
    p = assets.base_sample["prompt_token_ids"]
    g, c = assets.adapter("guardian").control_token_id, assets.adapter("citations").control_token_id
    return p[:10] + [g] + p[10:15] + [c] + p[15:20] + [assets.reset_token_id] + p[20:]


@pytest.fixture(scope="module")
def requests_and_outputs(switch_assets):
    reqs = {"base": switch_assets.base_sample["prompt_token_ids"], "mixed": mixed_prompt(switch_assets)}
    for a in switch_assets.adapters:
        reqs[a.name] = a.sample["prompt_token_ids"]
        reqs[a.name + ":no_control"] = a.sample["base_prompt_token_ids"]
    names = list(reqs)
    outs = reference(switch_assets.switch_dir,
                     [{"prompt_token_ids": reqs[n], "max_tokens": MAX_TOKENS} for n in names])
    return dict(zip(names, outs))


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_composed_config(switch_assets):
    base, switch = _config(switch_assets.base_dir), _config(switch_assets.switch_dir)
    assert switch["model_type"] == "granite_switch"
    assert switch["num_hidden_layers"] == base["num_hidden_layers"] + 2 == switch_assets.base_num_hidden_layers + 2
    assert switch["num_adapters"] == len(switch_assets.adapters) == 3
    assert switch["adapter_names"] == [a.name for a in switch_assets.adapters]
    assert switch["adapter_token_ids"] == switch_assets.adapter_token_ids
    assert switch["adapter_ranks"] == [a.rank for a in switch_assets.adapters]
    assert switch["vocab_size"] == switch_assets.switch_vocab_size == base["vocab_size"] + 4
    assert {a.technology for a in switch_assets.adapters} == {"lora", "alora"}
    assert len({a.rank for a in switch_assets.adapters}) > 1
    assert not switch["tie_word_embeddings"]


def test_manifest_ids_match_switch_tokenizer(switch_assets):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(os.path.join(switch_assets.switch_dir, "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(switch_assets.switch_dir)  # system transformers
    assert len(hf) == switch_assets.switch_vocab_size
    for tok in (lambda s: raw.token_to_id(s), hf.convert_tokens_to_ids):
        assert tok("<|base_reset|>") == switch_assets.reset_token_id == switch_assets.adapter_token_ids[0]
        for a in switch_assets.adapters:
            assert tok(a.control_token) == a.control_token_id == switch_assets.adapter_token_ids[a.index]
    start_of_role = hf.convert_tokens_to_ids("<|start_of_role|>")
    assert switch_assets.reset_substitute_token_id == start_of_role
    for a in switch_assets.adapters:
        expected_sub = a.alora_invocation_tokens[0] if a.technology == "alora" else start_of_role
        assert a.substitute_token_id == expected_sub
        assert switch_assets.adapter_substitute_token_ids[a.index] == expected_sub
        with open(os.path.join(a.path, "adapter_config.json")) as f:
            assert json.load(f).get("alora_invocation_tokens") == a.alora_invocation_tokens


def test_chat_template_placements(switch_assets):
    """One control token per render; swapping it for its substitute gives the
    no-adapter render; oracle (5.17) and system transformers render alike."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(switch_assets.switch_dir)
    items = [{"messages": a.sample["messages"], "adapter_name": a.name} for a in switch_assets.adapters]
    items += [{"messages": a.sample["messages"]} for a in switch_assets.adapters]
    rendered = render_batch(switch_assets.switch_dir, items)
    n = len(switch_assets.adapters)
    controls = set(switch_assets.adapter_token_ids)
    for a, ids, plain in zip(switch_assets.adapters, rendered[:n], rendered[n:]):
        assert ids == a.sample["prompt_token_ids"]
        assert plain == a.sample["base_prompt_token_ids"]
        assert [t for t in ids if t in controls] == [a.control_token_id]
        swapped = [a.substitute_token_id if t == a.control_token_id else t for t in ids]
        assert swapped == plain
        pos = ids.index(a.control_token_id)
        if a.technology == "lora":
            assert pos == 0
        elif a.alora_invocation_tokens[0] == plain[0]:  # invoked by the assistant role header
            assert plain[pos:] == a.alora_invocation_tokens
        else:  # invoked by text inside the user message
            assert plain[pos:pos + len(a.alora_invocation_tokens)] == a.alora_invocation_tokens
            assert re.search(r"\n<\|guardian\|>guardian> ", a.sample["text"])
        sys_ids = hf.apply_chat_template(a.sample["messages"], tokenize=True, add_generation_prompt=True,
                                         adapter_name=a.name)
        sys_ids = sys_ids["input_ids"] if hasattr(sys_ids, "keys") else sys_ids
        assert list(sys_ids) == ids, "transformers 5.24 renders the switch template differently"


def test_reference_routing_rule(switch_assets, requests_and_outputs):
    mapping = switch_assets.control_to_index
    mixed = requests_and_outputs["mixed"]
    assert mixed["prompt_token_ids"] == mixed_prompt(switch_assets)
    full = mixed["prompt_token_ids"] + mixed["token_ids"]
    assert len(mixed["adapter_indices"]) == len(full)
    assert mixed["adapter_indices"] == expected_routing(full, mapping)
    assert set(mixed["adapter_indices"]) == {0, 2, 3}  # guardian, citations, then reset to base
    assert mixed["adapter_indices"][-1] == 0
    for name, out in requests_and_outputs.items():
        full = out["prompt_token_ids"] + out["token_ids"]
        assert out["adapter_indices"] == expected_routing(full, mapping), name
    for a in switch_assets.adapters:  # the adapter stays active through generation
        assert requests_and_outputs[a.name]["adapter_indices"][-MAX_TOKENS:] == [a.index] * MAX_TOKENS


def test_adapters_change_outputs(switch_assets, requests_and_outputs):
    for a in switch_assets.adapters:
        with_ctrl, without = requests_and_outputs[a.name], requests_and_outputs[a.name + ":no_control"]
        assert without["adapter_indices"] == [0] * len(without["adapter_indices"])
        diff = max(abs(x - y) for x, y in zip(with_ctrl["logprobs"], without["logprobs"]))
        assert with_ctrl["token_ids"] != without["token_ids"] or diff > 1e-2, a.name


def test_no_control_matches_plain_granite(switch_assets, requests_and_outputs):
    """transformers 5.24 GraniteForCausalLM on the base == the Switch model with no control token."""
    from transformers import AutoTokenizer, GraniteForCausalLM

    out = requests_and_outputs["base"]
    model = GraniteForCausalLM.from_pretrained(switch_assets.base_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(switch_assets.base_dir)
    # The switch's lm_head gains one row per control token, each a copy of the
    # highest <|unused_N|> row; extend the base logits the same way for log_softmax.
    reserved = max(i for t, i in tok.get_vocab().items() if re.fullmatch(r"<\|unused_\d+\|>", t))
    n_extra = switch_assets.switch_vocab_size - switch_assets.base_vocab_size
    seq, tokens, logprobs = list(out["prompt_token_ids"]), [], []
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            ext = torch.cat([logits, logits[reserved].expand(n_extra)])
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(ext, dim=-1)[token]))
            seq.append(token)
    assert tokens == out["token_ids"]
    assert logprobs == pytest.approx(out["logprobs"], abs=1e-4)
    assert min(out["margins"]) > 1e-3
