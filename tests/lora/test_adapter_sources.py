"""Where adapters come from: a local folder, or a hub id (`org/adapter`) fetched with
huggingface_hub (stubbed here: no network in tests), with a clear error naming the id when
it cannot be had; and `--lora-dtype`, which must be the model's dtype."""

from __future__ import annotations

import pytest

from tests.lora.conftest import GREEDY, generate_one
from vllm import LLM
from vllm.lora.request import LoRARequest


def test_hub_id_adapter_is_downloaded_and_served(llama_dir, adapters, tokenizer, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, allow_patterns=(), local_files_only=False, **kwargs):
        calls.append((repo_id, local_files_only, list(allow_patterns)))
        if repo_id != "ibm/certainty-alora":
            raise OSError("404 Repository Not Found")
        return adapters["alora_certainty"]

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    llm = LLM(llama_dir, max_model_len=256, enable_lora=True, max_lora_rank=8)
    ids = tokenizer.encode("Is Paris in France?<|start_of_role|>certainty<|end_of_role|>")
    from_hub = generate_one(llm, ids, LoRARequest("certainty", 1, "ibm/certainty-alora"))
    local = generate_one(llm, ids, LoRARequest("certainty_local", 2, adapters["alora_certainty"]))
    assert from_hub.outputs[0].token_ids == local.outputs[0].token_ids
    assert calls[0][:2] == ("ibm/certainty-alora", False) and "adapter_config.json" in calls[0][2]
    with pytest.raises(ValueError, match="'ibm/missing' is neither a local folder nor reachable.*404"):
        llm.llm_engine.add_lora(LoRARequest("missing", 3, "ibm/missing"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        llm.llm_engine.add_lora(LoRARequest("offline", 4, "ibm/other"))
    with pytest.raises(ValueError, match="does not exist or is not a folder"):
        llm.llm_engine.add_lora(LoRARequest("local", 5, "/no/such/adapter"))
    assert generate_one(llm, ids, None, GREEDY).outputs[0].token_ids  # still serving


def test_lora_dtype_runs_adapters_in_that_dtype(llama_dir, adapters, tokenizer):
    """--lora-dtype bfloat16 on an fp32 model: the slots hold bf16 weights, adapted tokens follow
    the fp32 adapter closely, and base tokens are bit-for-bit the model's."""
    import torch

    ids = tokenizer.encode("one two three four five six")
    lora = LoRARequest("all", 1, adapters["lora_all"])
    outs = {}
    for lora_dtype in ("auto", "bfloat16"):
        llm = LLM(llama_dir, max_model_len=64, enable_lora=True, max_lora_rank=8, dtype="float32",
                  lora_dtype=lora_dtype)
        layers = llm.llm_engine.engine_core.runner.lora_manager.layers.values()
        expected = torch.float32 if lora_dtype == "auto" else torch.bfloat16
        assert all(a.dtype == expected for layer in layers for a in layer.lora_a + layer.lora_b)
        outs[lora_dtype] = (generate_one(llm, ids, lora), generate_one(llm, ids, None))
    (lora32, base32), (lora16, base16) = outs["auto"], outs["bfloat16"]
    assert base16.outputs[0].token_ids == base32.outputs[0].token_ids
    assert base16.outputs[0].cumulative_logprob == base32.outputs[0].cumulative_logprob
    assert lora16.outputs[0].token_ids == lora32.outputs[0].token_ids
    assert lora16.outputs[0].cumulative_logprob == pytest.approx(lora32.outputs[0].cumulative_logprob, abs=0.05)
    assert lora16.outputs[0].cumulative_logprob != lora32.outputs[0].cumulative_logprob  # bf16 really ran


def test_lora_dtype_must_be_a_float_dtype(llama_dir):
    with pytest.raises(ValueError, match="--lora-dtype: Unknown dtype 'int8'"):
        LLM(llama_dir, max_model_len=64, enable_lora=True, dtype="float32", lora_dtype="int8")


def test_running_request_keeps_its_admitted_weights(llama_dir, adapters, tokenizer, tmp_path):
    """The adapter's files change and its host copy is dropped mid-request (what an in-place
    reload does): the running request finishes with the weights it was admitted with."""
    import shutil

    from vllm import SamplingParams

    path = tmp_path / "swappable"
    shutil.copytree(adapters["lora_all"], path)
    ids = tokenizer.encode("one two three four five")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = LLM(llama_dir, max_model_len=128, enable_lora=True, max_lora_rank=8)
    expected = generate_one(reference, ids, LoRARequest("all", 1, adapters["lora_all"]), params).outputs[0].token_ids
    other = generate_one(reference, ids, LoRARequest("qkv", 2, adapters["lora_qkv"]), params).outputs[0].token_ids
    assert expected != other

    engine = LLM(llama_dir, max_model_len=128, enable_lora=True, max_lora_rank=8).llm_engine
    engine.add_request("r", {"prompt_token_ids": ids}, params, lora_request=LoRARequest("x", 1, str(path)))
    engine.step()
    shutil.rmtree(path)
    shutil.copytree(adapters["lora_qkv"], path)  # new weights at the same path
    engine.remove_lora(1)  # slot and host copy gone: a reload from the path would read the new files
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].token_ids == expected
    engine.add_request("s", {"prompt_token_ids": ids}, params, lora_request=LoRARequest("x2", 2, str(path)))
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[1].outputs[0].token_ids == other
