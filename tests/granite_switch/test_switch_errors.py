"""Granite Switch inputs the engine refuses, offline (`LLM`): each a ValueError whose
message names the problem. Checkpoints are copies of the composed one with one thing
changed (config.json, adapter_index.json or the safetensors' control table) and are
refused at load; bad requests (an unknown `adapter_name`, control tokens together with
a runtime `LoRARequest`) are refused per request and the engine keeps serving."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.granite_switch.oracle_env import Assets
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LUT_NAME = "model.switch.control_to_substitute_lut"


def copy_checkpoint(assets: Assets, tmp_path, edit_config=None, edit_index=None) -> str:
    """A copy of the composed checkpoint with config.json / adapter_index.json edited in place."""
    path = str(tmp_path / "switch")
    shutil.copytree(assets.switch_dir, path)
    for name, edit in (("config.json", edit_config), ("adapter_index.json", edit_index)):
        if edit is not None:
            with open(os.path.join(path, name)) as f:
                data = json.load(f)
            edit(data)
            with open(os.path.join(path, name), "w") as f:
                json.dump(data, f, indent=1)
    return path


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", max_model_len=256, **kwargs)


def set_fields(**fields):
    return lambda cfg: cfg.update(fields)


def drop_ms_code(cfg):
    del cfg["ms_code_m"]
    cfg.pop("switch_type", None)


def duplicate_control(cfg):
    ids = cfg["adapter_token_ids"]
    ids[2] = ids[1]  # guardian's control id = rewrite's


def out_of_vocab_control(cfg):
    cfg["adapter_token_ids"][-1] = cfg["vocab_size"] + 7


def mamba_first(cfg):
    # The format's two switch slots are trimmed off the end of layer_types, so a Mamba
    # layer must sit among the decoder layers to be seen.
    cfg["layer_types"][0] = "mamba"


# (id, config edit, regex the ValueError message must match)
CONFIG_CASES = [
    ("legacy-no-ms-code", drop_ms_code, r"legacy single-switch.*granite-switch >= 0\.1\.1"),
    ("legacy-switch-type-single", set_fields(switch_type="single"), r"legacy single-switch.*switch_type='single'"),
    ("shadow-residual-dual-stream", set_fields(dual_stream=True), r"Shadow-Residual.*not supported"),
    ("shadow-residual-cross-rank", set_fields(cross_stream_rank=4), r"Shadow-Residual.*not supported"),
    ("control-outside-vocab", out_of_vocab_control, r"control table is invalid.*\[0, 516\).*523"),
    ("duplicate-control-ids", duplicate_control, r"control table is invalid.*unique"),
    ("audio-front-end", set_fields(asr_enabled=True), r"audio front-end \(asr_enabled\).*not supported"),
    ("unfused-qkv", set_fields(unfused_qkv=True), r"unfused_qkv"),
    ("mixture-of-experts", set_fields(num_local_experts=4),
     r"mixture-of-experts MLPs \(num_local_experts=4\).*not support"),
    ("mamba-layer", mamba_first,  # transformers spells "mamba" "linear_attention"
     r"Mamba layers \(layer_types '(mamba|linear_attention)' at layers 0\).*not support"),
]


@pytest.mark.parametrize("edit,pattern", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_unsupported_config_is_refused_at_load(switch_assets, tmp_path, edit, pattern):
    path = copy_checkpoint(switch_assets, tmp_path, edit_config=edit)
    with pytest.raises(ValueError, match=re.compile(pattern, re.S)):
        make_llm(path)


def test_adapter_index_naming_an_unknown_control_id_is_refused(switch_assets, tmp_path):
    def edit(index):
        index["adapters"][1]["control_token"]["id"] = 600  # guardian's; the config says 514

    path = copy_checkpoint(switch_assets, tmp_path, edit_index=edit)
    with pytest.raises(ValueError, match=r"adapter_index\.json names adapter 'guardian' \(index 2\) with control "
                                         r"id 600, which is not in the config's adapter table"):
        make_llm(path)


def test_control_table_tensor_disagreeing_with_config_is_refused(switch_assets, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(switch_assets, tmp_path)
    weights_path = os.path.join(path, "model.safetensors")
    tensors = load_file(weights_path)
    guardian = switch_assets.adapter("guardian")
    lut = tensors[LUT_NAME].clone()
    assert lut[guardian.control_token_id] == guardian.substitute_token_id
    lut[guardian.control_token_id] = guardian.substitute_token_id + 1
    tensors[LUT_NAME] = lut
    save_file(tensors, weights_path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{LUT_NAME} disagrees with the config's control table .*"
                                         rf"at token ids \[{guardian.control_token_id}\]"):
        make_llm(path)


@pytest.fixture(scope="module")
def llm(switch_assets):
    return make_llm(switch_assets.switch_dir, enable_lora=True, max_lora_rank=8)


def assert_serves(llm: LLM, assets: Assets) -> None:
    """A good request after a refused one: the engine is unharmed and nothing is left queued."""
    engine = llm.llm_engine
    out = llm.chat(assets.adapter("rewrite").sample["messages"], GREEDY, use_tqdm=False,
                   chat_template_kwargs={"adapter_name": "rewrite"})[0]
    assert out.prompt_token_ids == assets.adapter("rewrite").sample["prompt_token_ids"]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert not engine.has_unfinished_requests()


def test_unknown_adapter_name_in_chat_lists_the_embedded_adapters(llm, switch_assets):
    messages = switch_assets.adapter("rewrite").sample["messages"]
    for bad in ("nope", "runtime_lora", "REWRITE"):
        with pytest.raises(ValueError, match=rf"Unknown adapter '{bad}': this Granite Switch checkpoint embeds "
                                             r"'rewrite', 'guardian', 'citations'\."):
            llm.chat(messages, GREEDY, chat_template_kwargs={"adapter_name": bad}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"adapter_name must be a string, got int"):
        llm.chat(messages, GREEDY, chat_template_kwargs={"adapter_name": 3}, use_tqdm=False)
    assert_serves(llm, switch_assets)


def test_control_tokens_with_a_runtime_lora_are_refused(llm, switch_assets):
    runtime = LoRARequest("runtime", 1, switch_assets.runtime_adapter_dir)
    base = switch_assets.base_sample["prompt_token_ids"]
    reset_only = base[:5] + [switch_assets.reset_token_id] + base[5:]
    cases = [(switch_assets.adapter(n).sample["prompt_token_ids"], f"<|{n}|>")
             for n in ("rewrite", "guardian", "citations")] + [(reset_only, "<|base_reset|>")]
    for prompt, token in cases:
        with pytest.raises(ValueError, match=rf"control tokens \['{re.escape(token)}'\] but also names the "
                                             r"runtime adapter 'runtime'"):
            llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=runtime, use_tqdm=False)
    # In a batch: the whole call is refused before anything runs.
    with pytest.raises(ValueError, match=r"runtime adapter 'runtime'"):
        llm.generate([{"prompt_token_ids": base}, {"prompt_token_ids": cases[0][0]}], GREEDY,
                     lora_request=[None, runtime], use_tqdm=False)
    assert_serves(llm, switch_assets)
    # The runtime LoRA itself, without control tokens, still works (and changes the output).
    plain = llm.generate([{"prompt_token_ids": base}], GREEDY, use_tqdm=False)[0]
    adapted = llm.generate([{"prompt_token_ids": base}], GREEDY, lora_request=runtime, use_tqdm=False)[0]
    assert adapted.outputs[0].token_ids != plain.outputs[0].token_ids
    assert not llm.llm_engine.has_unfinished_requests()
