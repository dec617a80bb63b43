"""Weight-only int8 / int4 quantization at load (vllm/model_executor/layers/quantization.py and
vllm/csrc/cpu/quant_linear.cpp): the stated rounding and packing, the native kernel and the tiled torch
path against `dequantize`, and the engine on a checkpoint whose weights are already on the
quantization grid, where quantizing is lossless and the engine must match transformers (and PEFT,
with an adapter on top) as closely as unquantized."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.lora.conftest import check_against_reference, generate_one
from tests.utils.adapters import load_peft_model, make_adapter
from tests.utils.checkpoints import load_hf_model
from tests.utils.reference import hf_greedy
from vllm import LLM
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers import quantization as q
from vllm.model_executor.layers.linear import Linear

CPU = torch.device("cpu")


def test_int8_rounds_per_channel():
    w = torch.tensor([[0.5, -1.27, 0.0, 1.0], [2.0, 1.0, -0.5, 0.013]])
    qw = q.quantize(w, "int8")
    assert qw.qweight.dtype == torch.int8 and qw.group == 4
    torch.testing.assert_close(qw.scales.view(-1), torch.tensor([1.27 / 127, 2.0 / 127]))
    assert qw.qweight.tolist() == [[50, -127, 0, 100], [127, 64, -32, 1]]  # round half to even: 63.5 -> 64
    assert (qw.dequantize() - w).abs().max() <= qw.scales.max() / 2


def test_int4_packs_two_per_byte_in_gguf_block_order():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16], w[0, 5], w[0, 31] = 7.0, -7.0, 3.0, 1.0  # scale 1
    qw = q.quantize(w, "int4")
    assert qw.qweight.shape == (1, 16) and qw.qweight.dtype == torch.uint8 and qw.scales.shape == (1, 1)
    packed = qw.qweight[0].tolist()
    assert packed[0] == (7 + 8) | ((-7 + 8) << 4)  # element 0 low nibble, element 16 high nibble
    assert packed[5] == (3 + 8) | (8 << 4)
    assert packed[15] == 8 | ((1 + 8) << 4)  # element 15 low, element 31 high
    torch.testing.assert_close(qw.dequantize(), w)
    with pytest.raises(ValueError, match="multiples of 32, got 48"):
        q.quantize(torch.randn(2, 48), "int4")
    with pytest.raises(ValueError, match="Unknown quantization 'int3'; supported: int8, int4"):
        q.quantize(w, "int3")


@pytest.mark.parametrize("method", q.METHODS)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])  # up to 16: native kernel; beyond: tiled torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_equals_dequantized_matmul(method, rows, dtype, monkeypatch):
    monkeypatch.setattr(q, "TILE_ROWS", 40)  # several tiles over 96 outputs
    gen = torch.Generator().manual_seed(rows)
    weight = q.quantize(torch.randn(96, 128, generator=gen), method)
    x = torch.randn(rows, 128, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    expected = (x.float() @ weight.dequantize().T + bias.float()).to(dtype)
    out = q.quantized_linear(x, weight, bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-5)


def test_native_kernel_builds_here():
    """CI machines have a compiler: a silent fallback to the slow path would hide a build break."""
    assert q.native_available(), q.native_build.unavailable_reason(q._SOURCE, q._WHAT)


def test_quantized_layer_keeps_no_full_precision_copy():
    layer = Linear(64, [32, 32], True, torch.float32, CPU)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(5, 64)
    reference = x @ q.quantize(layer.weight, "int4").dequantize().T + layer.bias
    layer.quantize("int4")
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.float32
    assert layer.weight_nbytes == 64 * 32 + 64 * 2 * 4  # half a byte per weight + one fp32 scale per 32
    layer.pack_for_onednn(batch_hint=64)  # a quantized layer stays quantized
    torch.testing.assert_close(layer(x), reference, atol=1e-4, rtol=1e-5)


def _on_grid(src: str, dst: str, method: str) -> str:
    """A copy of the checkpoint whose linear weights (not the LM head) are dequantize(quantize(w))."""
    model = load_hf_model(src)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(q.quantize(module.weight, method).dequantize())
    model.save_pretrained(dst)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(src, name), dst)
    return dst


@pytest.fixture(scope="module")
def grid_checkpoints(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("on_grid")
    return {m: _on_grid(checkpoints["llama"], str(root / m), m) for m in q.METHODS}


@pytest.mark.parametrize("method", q.METHODS)
def test_engine_on_grid_weights_matches_transformers_and_peft(method, grid_checkpoints, tokenizer, tmp_path):
    base = grid_checkpoints[method]
    adapter = make_adapter(base, str(tmp_path / "lora"), ["q_proj", "v_proj", "down_proj"], r=8, seed=5)
    llm = LLM(base, max_model_len=256, quantization=method, enable_lora=True, max_loras=1, max_lora_rank=8,
              dtype="float32")
    hf, peft = load_hf_model(base), load_peft_model(base, adapter)
    for text in ["What is the capital of France?", "one two three four five six seven eight " * 3]:
        ids = tokenizer.encode(text)
        check_against_reference(generate_one(llm, ids), hf_greedy(hf, ids, 10))
        check_against_reference(generate_one(llm, ids, LoRARequest("lora", 1, adapter)), hf_greedy(peft, ids, 10))


def test_bad_quantization_and_prequantized_checkpoints_are_refused(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="--quantization 'gptq' is not supported; supported: int8, int4"):
        LLM(checkpoints["llama"], quantization="gptq")
    path = str(tmp_path / "gptq")
    shutil.copytree(checkpoints["llama"], path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: quantized checkpoints are not supported "
                                         r"\(quantization_config has quant_method='gptq'\).*--quantization int8 or int4"):
        LLM(path, max_model_len=64)
