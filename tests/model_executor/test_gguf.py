"""GGUF checkpoints (vllm/model_executor/gguf_loader.py): each block format decodes to gguf-py's
values while staying packed; every linear layer of a loaded file equals transformers' (which
dequantizes the same file); and the engine on a tiny GGUF matches transformers end to end, with and
without a LoRA / aLoRA (PEFT on transformers' model).

The engine rounds the activations of quantized layers to int8 per block of 32, as llama.cpp does
(layers/quantization.py), the LM head included (it stays packed too), and the oracle does the same
at the input of transformers' base linears and LM head (not the adapters). Layer by layer that
makes the two equal to fp32 rounding. End to end it does not: a rounding is a step function, so a
1e-7 change in a hidden state (the two attention implementations differ by that much) can flip one,
and a flip moves later logprobs by up to ~0.5 nats on these tiny models (measured: perturbing
transformers' own input by 1e-7). Quantized files are therefore compared on the prompt logprobs of a
fixed sequence (no compounding through sampled tokens) by their mean difference, `MEAN_TOL`; a wrong
scale, nibble order or row permutation moves them by whole nats (they spread over ~10). F32 files
have no rounding: greedy tokens identical and logprobs within 1e-4.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import INVOCATION
from tests.lora.conftest import MAX_NEW, check_against_reference, generate_one
from tests.utils.adapters import ALL_LINEAR, make_adapter
from tests.utils.checkpoints import load_hf_model, make_checkpoint
from tests.utils.gguf_files import encode, write_gguf
from tests.utils.native_layers import allow_native, both_paths, count_native_calls, greedy_run, native_layers
from tests.utils.reference import hf_greedy, hf_prompt_logprobs
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor import gguf_loader
from vllm.model_executor.layers import quantization as q
from vllm.model_executor.layers.linear import Linear
from vllm.platforms import checkpoint_dtype, current_platform

MEAN_TOL = 0.15  # mean |logprob difference| over SEQUENCE for quantized files (see module docstring)
# K-quants need input sizes that are multiples of 256.
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
HEAD_GAIN = 30.0
SEQUENCE = list(range(40, 76)) + [5, 17, 230, 41, 99, 7, 350, 12]
PROMPT_LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=0)


def q4_k_m(name: str, weight: np.ndarray) -> T:
    """llama.cpp's Q4_K_M recipe in miniature: Q6_K for the head and for attn_v / ffn_down of some
    layers (here layer 0, so q/k/v and down_proj mix formats within one model), Q4_K elsewhere."""
    if name == "output.weight" or (name.startswith("blk.0.") and name.endswith(("attn_v.weight", "ffn_down.weight"))):
        return T.Q6_K
    return T.Q4_K


FILES = {
    "F32": lambda name, w: T.F32,
    "Q8_0": lambda name, w: T.Q8_0,
    "Q4_0": lambda name, w: T.Q4_0,
    "Q4_1": lambda name, w: T.Q4_1,
    "Q4_K_M": q4_k_m,
}


def checkpoint(path: str, arch: str) -> str:
    """Small weights (contractive layers: a flipped activation rounding stays a small change) and a
    scaled-up LM head (peaked next-token distributions: greedy decided by clear margins)."""
    make_checkpoint(path, arch, seed=3, initializer_range=0.02, **SHAPE)
    model = load_hf_model(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_GAIN)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_hf")
    return {arch: checkpoint(str(root / arch), arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def gguf_files(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    files = {kind: write_gguf(hf_dirs["llama"], str(root / f"llama-{kind}.gguf"), pick) for kind, pick in FILES.items()}
    for kind in ("F32", "Q8_0", "Q4_K_M"):  # Q4_K_M: q/k/v biases over slices of mixed formats
        files[f"qwen2-{kind}"] = write_gguf(hf_dirs["qwen2"], str(root / f"qwen2-{kind}.gguf"), FILES[kind])
    return files


def transformers_model(path: str, round_activations: bool):
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    if round_activations:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):  # every file here stores its head quantized too
                module.register_forward_pre_hook(_round_input)
    return model


def _round_input(module, args):
    x = args[0]
    return (q.round_activations(x.reshape(-1, x.shape[-1])).view(x.shape).to(x.dtype),)


def engine_model(llm):
    return llm.llm_engine.engine_core.runner.model


def prompt_logprobs(llm, ids, lora_request=None) -> torch.Tensor:
    out = generate_one(llm, ids, lora_request, PROMPT_LOGPROBS).prompt_logprobs
    return torch.tensor([out[i][ids[i]].logprob for i in range(1, len(ids))])


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K])
def test_each_block_format_decodes_to_gguf_values_and_stays_packed(qtype, tmp_path):
    w = np.random.RandomState(0).randn(16, 512).astype(np.float32) * 0.2
    path = str(tmp_path / "one.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", encode(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(path).tensors[0]
    expected = gguf.quants.dequantize(tensor.data, qtype)
    # The test encoders write llama.cpp's layouts: gguf-py reads back w to within a quantization step.
    step = {T.Q4_0: 1 / 8, T.Q4_1: 1 / 15, T.Q4_K: 2 / 15, T.Q6_K: 1 / 31}.get(qtype, 1 / 127)
    assert np.abs(expected - w).max() <= step * np.abs(w).max()
    decoded = gguf_loader._decode(tensor)
    if qtype.name in gguf_loader.DENSE_TYPES:
        assert decoded.dtype == {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        np.testing.assert_array_equal(decoded.float().numpy(), expected)
        return
    assert isinstance(decoded, q.QuantizedWeight)
    assert decoded.qweight.dtype in (torch.int8, torch.uint8) and decoded.in_features == 512
    np.testing.assert_allclose(decoded.dequantize().numpy(), expected, rtol=1e-6, atol=1e-7)
    # In memory: the file's bytes give or take the fp32 scales (Q6_K's 6-bit values take a byte each).
    assert decoded.nbytes <= {T.Q6_K: 1.32}.get(qtype, 1.35) * tensor.n_bytes
    if qtype in (T.Q4_0, T.Q4_1):  # d (and m) kept as stored, fp16: exactly the file's bytes
        assert decoded.scales.dtype == torch.float16 and decoded.nbytes == tensor.n_bytes
    if qtype in (T.Q4_K, T.Q6_K):  # their two-level scales kept: d (dmin) in fp32, sc (m) a byte each
        assert decoded.superblocks is not None
        assert decoded.nbytes <= {T.Q4_K: 1.06, T.Q6_K: 1.32}[qtype] * tensor.n_bytes


@pytest.mark.parametrize("kind", list(FILES) + ["qwen2-F32", "qwen2-Q8_0"])
def test_engine_on_a_gguf_file_matches_transformers(kind, gguf_files):
    path = gguf_files[kind]
    quantized = not kind.endswith("F32")
    llm = LLM(path, max_model_len=128, dtype="float32")
    model = engine_model(llm)
    hf = transformers_model(path, round_activations=quantized)
    hf_modules = dict(hf.named_modules())
    # Layer by layer: each of our (fused) linears equals transformers' linears of its slices.
    gen = torch.Generator().manual_seed(0)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    for name, layer in linears.items():
        parent, leaf = name.rsplit(".", 1)
        refs = [hf_modules[f"{parent}.{sub}"] for sub in model.packed_modules_mapping.get(leaf, [leaf])]
        x = torch.randn(q.NATIVE_MAX_ROWS_INT4 + 1, layer.input_size, generator=gen)
        for rows in (x[:3], x[:40], x):  # the native kernel's row counts, then (past every format's) the tiled path's
            xr = q.round_activations(rows) if quantized else rows
            expected = torch.cat([F.linear(xr, ref.weight, ref.bias) for ref in refs], dim=1)
            torch.testing.assert_close(layer(rows), expected, atol=2e-5, rtol=1e-5)
    # The head too (the embedding's lookup table is dequantized, exactly as transformers does).
    head = model.lm_head
    x = torch.randn(5, head.hidden_size, generator=gen)
    expected = F.linear(q.round_activations(x) if quantized else x, hf.lm_head.weight)
    torch.testing.assert_close(head(x), expected, atol=2e-5, rtol=1e-5)
    assert (head._quantized is not None) == quantized
    torch.testing.assert_close(model.model.embed_tokens.weight, hf.model.embed_tokens.weight, atol=0, rtol=0)
    # Memory: quantized files stay packed, about the file's size and nowhere near fp32.
    in_memory = sum(m.weight_nbytes for m in linears.values()) + head.weight_nbytes
    in_file = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors
                  if (t.name.startswith("blk.") or t.name == "output.weight") and len(t.shape) == 2)
    full_precision = (sum(m.output_size * m.input_size * 4 for m in linears.values())
                      + head.vocab_size * head.hidden_size * 4)
    if quantized:
        assert in_memory <= 1.5 * in_file and in_memory < 0.3 * full_precision
    else:
        assert in_memory == in_file == full_precision
    # End to end (see the module docstring for why quantized files compare prompt logprobs).
    if quantized:
        ours, ref = prompt_logprobs(llm, SEQUENCE), torch.tensor(hf_prompt_logprobs(hf, SEQUENCE))
        assert (ours - ref).abs().mean() < MEAN_TOL
    else:
        for ids in (SEQUENCE[:8], SEQUENCE):
            check_against_reference(generate_one(llm, ids), hf_greedy(hf, ids, MAX_NEW))



@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "qwen2-Q8_0", "qwen2-Q4_K_M"])
def test_slices_of_one_format_are_stacked_and_decode_natively(kind, gguf_files):
    """A file stores q/k/v and gate/up apart; slices of one format become one weight (one kernel
    call, the same values as the slices side by side, bit for bit) and a decoder layer of such
    linears runs as one native call, Q4_K's included. Q4_K_M's layer 0 mixes Q6_K into q/k/v:
    kept per slice, which the native layer takes as slices too."""
    model = engine_model(LLM(gguf_files[kind], max_model_len=128, dtype="float32"))
    gen = torch.Generator().manual_seed(1)
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, Linear)):
        stored = layer.quantized_weights()
        mixed = kind.endswith("Q4_K_M") and name == "model.layers.0.self_attn.qkv_proj"
        assert len(stored) == (3 if mixed else 1), name
        if mixed or len(layer.output_sizes) == 1:
            continue
        (w,) = stored
        x = torch.randn(3, layer.input_size, generator=gen)
        rows = [slice(start, start + size) for start, size in zip(layer._offsets, layer.output_sizes)]
        slices = [q.tile(w.rows(r)) if w.tiled else w.rows(r) for r in rows]  # each in the stacked layout
        expected = torch.cat([q.quantized_linear(x, s, None) for s in slices], dim=1)
        if layer.bias is not None:
            expected += layer.bias
        assert torch.equal(layer(x), expected), name
    # Q4_K's offsets go into the int4 kernel too, and Q4_K_M's layer 0 passes q/k/v as slices.
    assert all(layer._native_decode_layer() is not None for layer in model.model.layers)



@pytest.mark.parametrize("qtype, stored", [(T.BF16, torch.bfloat16), (T.F16, torch.float16), (T.F32, None),
                                           (T.Q8_0, None)])
def test_auto_dtype_takes_a_16_bit_file_as_a_16_bit_checkpoint(qtype, stored, hf_dirs, tmp_path):
    """dtype="auto" reads a BF16 / F16 file as it reads a bf16 / fp16 checkpoint (on a CPU: bf16 where it
    has native bf16); F32 and quantized files run in fp32, the precision llama.cpp computes in."""
    path = write_gguf(hf_dirs["llama"], str(tmp_path / f"{qtype.name}.gguf"), lambda name, w: qtype)
    assert checkpoint_dtype(gguf_loader.load_gguf_config(path)) == stored
    llm = LLM(path, max_model_len=64)
    expected = current_platform("cpu").auto_dtype(stored)
    assert llm.llm_engine.model_config.dtype == expected
    assert all(p.dtype == expected for p in engine_model(llm).parameters() if p.dim() == 1)  # the norms



def test_gguf_layer_takes_the_fewest_rows_of_its_slices(gguf_files, tokenizer, monkeypatch):
    """In the row layout (no row tiles) a native layer takes as many rows as the fewest of its slices'
    formats run natively: Q4_K_M's layer 0 holds Q6_K slices (int8 in groups), layer 1 Q4_K ones; the
    native layers give the Python layers' tokens and logprobs there too."""
    monkeypatch.setattr(q, "tile_rows", lambda: 0)
    llm = LLM(gguf_files["Q4_K_M"], max_model_len=128)
    linears = [m for layer in native_layers(llm) for m in layer.modules() if isinstance(m, Linear)]
    assert linears and not any(w.tiled for m in linears for w in m.quantized_weights())
    native, python = both_paths(llm, tokenizer)  # builds the native layers on the first decode
    assert native == python
    assert [layer._native_decode.max_rows for layer in native_layers(llm)[:2]] == [
        q.NATIVE_MAX_ROWS_INT8_GROUPED, q.NATIVE_MAX_ROWS_INT4]


@pytest.mark.parametrize(("kind", "dtype"), [("Q4_K_M", "float32"), ("Q4_K_M", "bfloat16"), ("Q4_0", "float32"),
                                           ("Q4_1", "bfloat16"), ("qwen2-Q4_K_M", "float32"), ("qwen2-Q4_K_M", "bfloat16")])
def test_gguf_layers_decode_natively_with_the_python_layers_bits(kind, dtype, gguf_files, tokenizer, monkeypatch):
    """Q4_K's offsets in the int4 kernel, q/k/v of mixed formats as slices (with Qwen2's biases
    added after them): the native layers give the Python layers' tokens and logprobs bit for bit
    (both call the same kernels), with batched decode steps (a slice's columns through a buffer)
    and with one row (written in place). In row tiles (AVX512-VNNI) Q4_K and Q6_K run natively at any
    row count; the row layout's limits are test_gguf_layer_takes_the_fewest_rows_of_its_slices'."""
    calls = count_native_calls(monkeypatch)
    llm = LLM(gguf_files[kind], max_model_len=128, dtype=dtype)
    native, python = both_paths(llm, tokenizer)
    assert 3 in calls and native == python
    if kind.endswith("Q4_K_M") and q.tile_rows():
        assert [layer._native_decode.max_rows for layer in native_layers(llm)[:2]] == [q.NATIVE_MAX_ROWS_TILES] * 2
    calls.clear()
    one = ["the native layer takes one row"]
    greedy_run(llm, tokenizer, prompts=one)  # fills the prefix cache the two runs below read alike
    native = greedy_run(llm, tokenizer, prompts=one)
    allow_native(llm, False)
    python = greedy_run(llm, tokenizer, prompts=one)
    assert 1 in calls and native == python


def test_stacking_refuses_slices_that_differ():
    a = q.quantize(torch.randn(8, 64), "int4")
    assert q.stack_rows([a, q.quantize(torch.randn(4, 64), "int8")]) is None
    assert q.stack_rows([a, q.quantize(torch.randn(4, 96), "int4")]) is None
    fp16 = q.QuantizedWeight("int4", a.qweight, a.scales.half(), a.group, a.in_features)
    assert q.stack_rows([a, fp16]) is None
    with_offsets = q.QuantizedWeight("int4", a.qweight, a.scales, a.group, a.in_features, torch.zeros(8, 2))
    assert q.stack_rows([a, with_offsets]) is None
    stacked = q.stack_rows([a, a])
    assert stacked.out_features == 16 and torch.equal(stacked.dequantize(), torch.cat([a.dequantize()] * 2))


def test_lora_and_alora_on_a_quantized_gguf_match_peft(gguf_files, hf_dirs, tokenizer, tmp_path):
    path = gguf_files["Q4_K_M"]
    invocation = tokenizer.encode(INVOCATION, add_special_tokens=False)
    # PEFT adapters need only module names and shapes: the HF folder the file was written from has them.
    lora = make_adapter(hf_dirs["llama"], str(tmp_path / "lora"), ALL_LINEAR, r=8, seed=21)
    alora = make_adapter(hf_dirs["llama"], str(tmp_path / "alora"), ["q_proj", "v_proj", "down_proj"], r=4, seed=22,
                         invocation_tokens=invocation)
    llm = LLM(path, max_model_len=128, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    start = 30
    ids = SEQUENCE[:start] + invocation + [33, 34]
    base = prompt_logprobs(llm, ids)
    for i, adapter in enumerate([lora, alora], start=1):
        ours = prompt_logprobs(llm, ids, LoRARequest(f"adapter{i}", i, adapter))
        peft = PeftModel.from_pretrained(transformers_model(path, round_activations=True), adapter).eval()
        ref = torch.tensor(hf_prompt_logprobs(peft, ids))
        assert (ours - ref).abs().mean() < MEAN_TOL
        changed = slice(0, None) if adapter == lora else slice(start, None)
        assert (ours - base)[changed].abs().mean() > 5 * MEAN_TOL  # the adapter matters: the check has teeth
    # The aLoRA leaves every position before its invocation to the base model, bit for bit.
    assert torch.equal(ours[:start], base[:start])


def test_tokenizer_comes_from_the_file_unless_given(gguf_files, hf_dirs, tokenizer):
    path = gguf_files["Q8_0"]
    llm = LLM(path, max_model_len=64, dtype="float32")
    text = "What is the capital of France? The capital of France is Paris."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_tokenizer().encode(text, add_special_tokens=False) == ids
    assert llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_token_ids[-len(ids):] == ids
    llm = LLM(path, tokenizer=hf_dirs["llama"], max_model_len=64, dtype="float32")
    assert llm.llm_engine.model_config.tokenizer_dir == hf_dirs["llama"]


def _small_file(path: str, arch: str, types: dict[str, T]) -> str:
    writer = gguf.GGUFWriter(path, arch)
    for name, qtype in types.items():
        writer.add_tensor(name, gguf.quants.quantize(np.ones((4, 256), dtype=np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_gguf_models_are_refused(gguf_files, tmp_path):
    with pytest.raises(ValueError, match="--quantization int8 cannot apply to the GGUF model .* Drop --quantization"):
        LLM(gguf_files["Q8_0"], quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with a GGUF model is not supported"):
        LLM(gguf_files["Q8_0"], tensor_parallel_size=2)
    with pytest.raises(ValueError, match="GGUF model '.*absent.gguf' is not an existing file"):
        LLM(str(tmp_path / "absent.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        LLM(str(tmp_path / "junk.gguf"))
    gpt2 = _small_file(str(tmp_path / "gpt2.gguf"), "gpt2", {"blk.0.attn_q.weight": T.F16})
    with pytest.raises(ValueError, match=r"holds a 'gpt2' model; supported GGUF architectures: llama \(Llama, "
                                         r"Mistral\), qwen2"):
        LLM(gpt2)
    five_bit = _small_file(str(tmp_path / "q5.gguf"), "llama", {"blk.0.attn_q.weight": T.Q5_0})
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' .* is Q5_0; supported tensor types: F32, F16, BF16, "
                                         "Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"):
        next(gguf_loader.iterate_gguf_weights(five_bit, None))
    mixed = _small_file(str(tmp_path / "mixed.gguf"), "llama", {"blk.0.ffn_gate.weight": T.Q8_0,
                                                                "blk.0.ffn_up.weight": T.F16})
    with pytest.raises(ValueError, match="blk.0.ffn_gate.weight, blk.0.ffn_up.weight mix quantized and dense"):
        next(gguf_loader.iterate_gguf_weights(mixed, None))
