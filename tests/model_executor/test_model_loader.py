"""Loading: sharded safetensors and PyTorch .bin checkpoints load identically to the
single-file one, dummy weights read no file, and every failure is a ValueError that
says what is wrong."""

from __future__ import annotations

import inspect
import json
import os
import shutil

import pytest
import torch

from tests.model_executor.configs import model_config_for
from tests.utils.checkpoints import load_hf_model
from vllm.model_executor.hf_files import find_weight_files, iterate_weights, resolve_model_dir
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.model_loader import DUMMY_WEIGHT_RANGE, get_model

CPU = torch.device("cpu")


def config_only_copy(src: str, dst: str) -> str:
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    return dst


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    params_b = dict(b.named_parameters())
    assert params_b.keys() == dict(a.named_parameters()).keys()
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), name


@pytest.fixture(scope="module")
def reference(checkpoints):
    return get_model(model_config_for(checkpoints["qwen2"]), CPU)


def test_sharded_safetensors_load_identically(checkpoints, reference, tmp_path):
    sharded = str(tmp_path / "sharded")
    load_hf_model(checkpoints["qwen2"]).save_pretrained(sharded, max_shard_size="40KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 2
    files, fmt = find_weight_files(sharded)
    assert fmt == "safetensors" and sorted(os.path.basename(p) for p in files) == sorted(shards)
    # A stray safetensors file not in the index (e.g. Mistral's consolidated copy) is not read.
    torch.save({}, os.path.join(sharded, "consolidated.safetensors"))
    assert_same_parameters(get_model(model_config_for(sharded), CPU), reference)


def test_pytorch_bin_checkpoint(checkpoints, reference, tmp_path):
    folder = config_only_copy(checkpoints["qwen2"], str(tmp_path / "bin"))
    torch.save(load_hf_model(checkpoints["qwen2"]).state_dict(), os.path.join(folder, "pytorch_model.bin"))
    assert find_weight_files(folder)[1] == "pt"
    assert_same_parameters(get_model(model_config_for(folder, load_format="pt"), CPU), reference)


def test_weights_are_streamed(checkpoints):
    files, fmt = find_weight_files(checkpoints["llama"])
    stream = iterate_weights(files, fmt)
    assert inspect.isgenerator(stream)
    name, tensor = next(stream)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)


def test_dummy_weights_read_no_file(checkpoints, tmp_path):
    folder = config_only_copy(checkpoints["qwen3"], str(tmp_path / "no_weights"))
    config = model_config_for(folder, load_format="dummy", dtype=torch.bfloat16)
    model = get_model(config, CPU)
    assert not model.training
    hf = config.hf_config
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (hf.num_attention_heads * 32 + 2 * hf.num_key_value_heads * 32,
                                          hf.hidden_size)
    assert attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.shape == (hf.vocab_size, hf.hidden_size)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            assert bool((module.weight == 1).all())
    w = attn.o_proj.weight.float()
    assert 0 < w.abs().max() <= DUMMY_WEIGHT_RANGE and w.std() > 0
    again = get_model(config, CPU)  # seeded: the same weights every time
    assert torch.equal(again.model.layers[0].self_attn.o_proj.weight, attn.o_proj.weight)


def test_folder_without_weights(checkpoints, tmp_path):
    folder = config_only_copy(checkpoints["llama"], str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=rf"No model weights found in '{folder}'.*safetensors.*pytorch_model"):
        get_model(model_config_for(folder), CPU)


def test_unknown_architecture(checkpoints):
    config = model_config_for(checkpoints["llama"], architecture="FalconForCausalLM")
    with pytest.raises(ValueError, match="FalconForCausalLM is not supported. Supported: .*LlamaForCausalLM"):
        get_model(config, CPU)


def test_resolve_model_dir(checkpoints, monkeypatch, tmp_path):
    assert resolve_model_dir(checkpoints["llama"]) == checkpoints["llama"]
    with pytest.raises(ValueError, match="is not an existing folder"):
        resolve_model_dir(str(tmp_path / "missing"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="neither a local folder nor reachable.*HF_HUB_OFFLINE"):
        resolve_model_dir("no-such-org/no-such-model-for-tests")


def test_resolve_hub_id(checkpoints, monkeypatch, tmp_path):
    """Online path with huggingface_hub stubbed: safetensors first, .bin as fallback,
    hub errors turned into ValueError."""
    import huggingface_hub

    calls, hub_options = [], []
    bin_only = config_only_copy(checkpoints["llama"], str(tmp_path / "bin_only"))

    def fake_download(repo_id, revision=None, cache_dir=None, token=None, allow_patterns=(), ignore_patterns=(),
                      local_files_only=False):
        calls.append((repo_id, revision, list(allow_patterns), local_files_only))
        hub_options.append((cache_dir, token))
        if repo_id == "org/broken":
            raise OSError("connection refused")
        return checkpoints["llama"] if repo_id == "org/safetensors" else bin_only

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_dir("org/safetensors", revision="v1") == checkpoints["llama"]
    assert calls == [("org/safetensors", "v1", calls[0][2], False)]
    assert "*.safetensors" in calls[0][2] and "*.json" in calls[0][2]
    calls.clear()
    assert resolve_model_dir("org/bin") == bin_only
    assert len(calls) == 2 and "pytorch_model*.bin" in calls[1][2] and "*.safetensors" not in calls[1][2]
    with pytest.raises(ValueError, match="'org/broken' is neither a local folder nor reachable.*connection refused"):
        resolve_model_dir("org/broken")
    hub_options.clear()
    resolve_model_dir("org/safetensors", cache_dir="/downloads", token="hf_x")  # --download-dir, --hf-token
    assert hub_options == [("/downloads", "hf_x")]


def _weights(path: str):
    files, fmt = find_weight_files(path)
    return list(iterate_weights(files, fmt))


def test_load_weights_errors(checkpoints):
    path = checkpoints["llama"]
    config = model_config_for(path, load_format="dummy")
    weights = _weights(path)
    model = get_model(config, CPU)
    with pytest.raises(ValueError, match=r"missing 1 model parameter\(s\): model.norm.weight"):
        model.load_weights((n, t) for n, t in weights if n != "model.norm.weight")
    with pytest.raises(ValueError, match=r"qkv_proj.weight \(slices k_proj\)"):
        model.load_weights((n, t) for n, t in weights if n != "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' into .*gate_up_proj.*shape mismatch"):
        model.load_weights((n, t[:-1] if n == "model.layers.0.mlp.up_proj.weight" else t) for n, t in weights)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.rope_scale' has no matching model parameter"):
        model.load_weights(weights + [("model.layers.0.self_attn.rope_scale", torch.zeros(1))])
    # Recomputed buffers are skipped; a tied model ignores a stored lm_head copy.
    model.load_weights(weights + [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])
    tied_path = checkpoints["llama3_tied"]
    tied = get_model(model_config_for(tied_path, load_format="dummy"), CPU)
    tied_weights = _weights(tied_path)
    embed = dict(tied_weights)["model.embed_tokens.weight"]
    tied.load_weights(tied_weights + [("lm_head.weight", torch.zeros_like(embed))])
    assert torch.equal(tied.lm_head.weight, embed)
