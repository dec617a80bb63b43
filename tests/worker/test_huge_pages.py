"""Weights and KV cache on transparent huge pages (vllm/worker/huge_pages.py): a move keeps every
value, every tensor's identity and every sharing between views; where huge pages are off nothing
moves; the kernel does grant 2 MB pages to an arena where THP is "madvise" or "always"; and an
engine with its weights and KV cache moved gives bitwise the outputs of one without."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.worker import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")


def _on_arena(t: torch.Tensor, arena_ptr: int) -> bool:
    return t.untyped_storage().data_ptr() == arena_ptr


@needs_thp
def test_a_move_keeps_values_identity_and_sharing():
    base = torch.randn(100, 37)
    rows = base[10:20]  # a view: must keep sharing base's memory
    wide = torch.randn(64, 48)
    transposed = wide.t()  # non-contiguous view of the same storage
    param = torch.nn.Parameter(torch.randn(300).to(torch.bfloat16), requires_grad=False)
    codes = torch.randint(-127, 127, (33, 17), dtype=torch.int8)
    empty = torch.empty(0)
    tensors = [base, rows, wide, transposed, param, codes, empty, base]  # base twice: moved once
    before = {id(t): t.clone() for t in tensors}
    empty_ptr = empty.data_ptr()

    moved = huge_pages.move_to_huge_pages(tensors)

    assert moved >= sum(t.numel() * t.element_size() for t in (base, wide, param, codes))
    arena = base.untyped_storage().data_ptr()
    for t in (base, rows, wide, transposed, param, codes):
        assert _on_arena(t, arena)
        assert torch.equal(t, before[id(t)])
    assert isinstance(param, torch.nn.Parameter) and param.dtype == torch.bfloat16 and param.shape == (300,)
    assert transposed.stride() == (1, 48) and not transposed.is_contiguous()
    assert empty.data_ptr() == empty_ptr  # nothing to move
    base[15, 3] = 42.0  # the views still see their base
    assert rows[5, 3] == 42.0
    wide[2, 7] = -1.0
    assert transposed[7, 2] == -1.0


@needs_thp
def test_tensors_of_several_dtypes_on_one_storage_keep_their_alignment():
    raw = torch.arange(64, dtype=torch.uint8)
    tail = raw[3:9]
    floats = raw[8:24].view(torch.float32)  # storage offset 2 in float32 elements
    before_tail, before_floats = tail.clone(), floats.clone()

    huge_pages.move_to_huge_pages([tail, floats])

    assert floats.data_ptr() % 4 == 0 and torch.equal(floats, before_floats) and torch.equal(tail, before_tail)
    floats[0] = 0.0  # bytes 8..11: tail's last byte is byte 8
    assert tail[5] == 0


def test_nothing_moves_where_huge_pages_are_off(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    t = torch.randn(1000)
    ptr = t.data_ptr()
    assert not huge_pages.available()
    assert huge_pages.move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr
    assert huge_pages.zeros((2, 3), torch.float32, 4) is None


@needs_thp
def test_zeros_are_zero_contiguous_and_apart():
    caches = huge_pages.zeros((2, 5, 8, 3, 16), torch.bfloat16, 3)
    assert len(caches) == 3
    for c in caches:
        assert c.shape == (2, 5, 8, 3, 16) and c.dtype == torch.bfloat16 and c.is_contiguous()
        assert not c.any() and c.data_ptr() % huge_pages.ALIGN == 0
    caches[0].fill_(1)
    assert not caches[1].any() and not caches[2].any()


def _huge_kb_over(start: int, end: int) -> int:
    """AnonHugePages (kB) of this process's mappings overlapping [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@needs_thp
def test_the_kernel_backs_an_arena_with_huge_pages():
    weights = [torch.randn(1024, 1024) for _ in range(3)]  # 12 MB
    huge_pages.move_to_huge_pages(weights)
    start = weights[0].untyped_storage().data_ptr()
    assert _huge_kb_over(start, start + 12 * 2**20) >= 2048


@needs_thp
def test_an_engine_on_huge_pages_gives_the_same_outputs(llama_dir, tokenizer, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": tokenizer.encode("What is the capital of France?")}
    results = {}
    for on in ("1", "0"):
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", on)
        llm = LLM(llama_dir, dtype="float32", max_model_len=128)
        runner = llm.llm_engine.engine_core.runner
        weights = {p.untyped_storage().data_ptr() for p in runner.model.parameters() if p.numel()}
        caches = {c.untyped_storage().data_ptr() for c in runner.kv_caches}
        if on == "1":
            assert len(weights) == 1 and len(caches) == 1  # one arena each
        else:
            assert len(weights) > 1 and len(caches) == len(runner.kv_caches)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        results[on] = (out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs])
        del llm, runner
    assert results["1"] == results["0"]


@needs_thp
def test_quantized_weights_move_with_the_rest(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=128, quantization="int4")
    model = llm.llm_engine.engine_core.runner.model
    quantized = [t for m in model.modules() for q in getattr(m, "quantized_weights", list)() for t in q.tensors()]
    assert quantized
    storages = {t.untyped_storage().data_ptr() for t in quantized}
    storages |= {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
    assert len(storages) == 1
