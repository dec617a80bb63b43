"""dtype="auto" on the CPU and the CPU thread count: bf16 for a bf16/fp16 checkpoint only where
the CPU computes bf16 natively (AVX512-BF16 or AMX; elsewhere bf16 is emulated and slower than
fp32), fp32 otherwise, said in the start-up log; bf16 serving checked against transformers in
bf16; `cpu_threads` sets torch's intra-op threads."""

from __future__ import annotations

import os

import pytest
import torch

from tests.utils.checkpoints import load_hf_model
from tests.utils.logs import logged_messages
from tests.utils.reference import hf_greedy
from vllm import LLM, SamplingParams, platforms
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import Platform

TEXTS = ["What is the capital of France?", "The quick brown fox", "one two three four five six seven " * 3]
# bf16 has 8 bits of mantissa: both sides round at different points (fused qkv, oneDNN
# linears, the order of sums), so logprobs agree to a few hundredths, not to fp32's 1e-4.
BF16_LOGPROB_ATOL = 0.1


@pytest.fixture(scope="module")
def half_checkpoints(checkpoints, tmp_path_factory):
    """The llama test checkpoint re-saved in bf16 and in fp16 (config dtype says so)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        path = str(tmp_path_factory.mktemp(str(dtype).removeprefix("torch.")))
        load_hf_model(checkpoints["llama"]).to(dtype).save_pretrained(path)
        for name in os.listdir(checkpoints["llama"]):
            if name.startswith(("tokenizer", "special_tokens", "generation_config")):
                with open(os.path.join(checkpoints["llama"], name), "rb") as src, \
                        open(os.path.join(path, name), "wb") as dst:
                    dst.write(src.read())
        out[dtype] = path
    return out


@pytest.mark.parametrize("native, stored, expected", [
    (True, torch.bfloat16, torch.bfloat16),
    (True, torch.float16, torch.bfloat16),  # fp16 checkpoints run as bf16 on the CPU
    (True, torch.float32, torch.float32),
    (True, None, torch.float32),
    (False, torch.bfloat16, torch.float32),
    (False, torch.float16, torch.float32),
])
def test_auto_dtype_rule(native, stored, expected):
    assert Platform("cpu", torch.float32, native_bf16=native).auto_dtype(stored) == expected
    assert Platform("cuda", torch.bfloat16).auto_dtype(stored) == torch.bfloat16


@pytest.mark.parametrize("native", [True, False])
def test_engine_config_takes_checkpoint_dtype_and_logs_why(native, half_checkpoints, monkeypatch):
    monkeypatch.setattr(platforms, "cpu_has_native_bf16", lambda: native)
    with logged_messages("vllm.engine.arg_utils") as messages:
        config = EngineArgs(model=half_checkpoints[torch.float16], device="cpu").create_engine_config()
    assert config.model_config.dtype == (torch.bfloat16 if native else torch.float32)
    reason = "this CPU has native bf16" if native else "this CPU has no native bf16 (AVX512-BF16 or AMX)"
    expected = f"dtype=auto on CPU: {'bfloat16' if native else 'float32'} (checkpoint dtype float16; {reason})."
    assert expected in messages
    # An explicit dtype is taken as given, whatever the CPU.
    explicit = EngineArgs(model=half_checkpoints[torch.float16], device="cpu", dtype="float32")
    assert explicit.create_engine_config().model_config.dtype == torch.float32


def test_bf16_serving_matches_transformers_in_bf16(half_checkpoints, tokenizer, monkeypatch):
    monkeypatch.setattr(platforms, "cpu_has_native_bf16", lambda: True)
    path = half_checkpoints[torch.bfloat16]
    llm = LLM(path, max_model_len=128)
    assert llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    hf = load_hf_model(path).to(torch.bfloat16)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, 8)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < BF16_LOGPROB_ATOL


def test_cpu_threads(llama_dir, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = EngineArgs(model=llama_dir, device="cpu").create_engine_config().device_config.cpu_threads
    assert default == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer, got 0"):
        EngineArgs(model=llama_dir, device="cpu", cpu_threads=0).create_engine_config()
    before = torch.get_num_threads()
    try:
        LLM(llama_dir, max_model_len=64, cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_explicit_half_dtype_loads_on_any_cpu(llama_dir, dtype):
    """oneDNN packs half-precision weights only on CPUs that support them; elsewhere the
    engine keeps F.linear instead of failing at load."""
    llm = LLM(llama_dir, max_model_len=64, dtype=str(dtype).removeprefix("torch."))
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_cpu_threads_default_honours_omp_num_threads(llama_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EngineArgs(model=llama_dir, device="cpu").create_engine_config().device_config.cpu_threads == 1


def test_cpu_engines_ask_for_huge_pages(llama_dir, monkeypatch):
    """A CPU engine sets THP_MEM_ALLOC_ENABLE before it allocates (a user's value wins), so where
    the kernel gives transparent huge pages on request the KV cache lands on them: checked in a
    fresh process, as torch reads the setting at its first allocation."""
    import subprocess
    import sys

    script = (
        "import os\n"
        "from vllm import LLM\n"
        "llm = LLM(os.environ['MODEL'], max_model_len=64, kv_cache_memory_bytes=64 << 20)\n"
        "huge = int(open('/proc/self/smaps_rollup').read().split('AnonHugePages:')[1].split()[0])\n"
        "print(os.environ['THP_MEM_ALLOC_ENABLE'], huge)\n"
    )

    def run(env):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "MODEL": llama_dir, **env})
        assert result.returncode == 0, result.stderr[-2000:]
        setting, huge_kb = result.stdout.split()[-2:]
        return setting, int(huge_kb)

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # earlier engines in this process set it
    setting, huge_kb = run({})
    assert setting == "1"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        mode = "[never]"
    if "[madvise]" in mode or "[always]" in mode:
        assert huge_kb >= 32 << 10  # most of the 64 MB KV cache
    setting, huge_kb = run({"THP_MEM_ALLOC_ENABLE": "0"})
    assert setting == "0"
    if "[madvise]" in mode:  # nothing asks for them then
        assert huge_kb == 0
