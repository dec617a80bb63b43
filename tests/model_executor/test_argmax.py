"""The sampler's native CPU argmax (vllm/csrc/cpu/argmax.cpp through sampler.argmax_rows) against
torch.argmax: the same index on ties (the first), NaNs (the first NaN), infinities, signed zeros,
rows shorter than a vector and with tails, several rows on two threads; the torch path for what
the kernel does not take; and a Sampler with the kernel samples what one without it samples,
greedy and seeded random rows alike. No model needed."""

from __future__ import annotations

import pytest
import torch

from tests.utils.threads import on_thread_counts
from vllm.model_executor.layers.sampler import Sampler, SamplingMetadata, argmax_rows, native_argmax_unavailable_reason

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    reason = native_argmax_unavailable_reason()
    assert reason is None, f"the argmax kernel must build on this machine: {reason}"


def special_rows(width: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of `width` values: random, with the maximum repeated, with NaNs, all -inf, +inf among
    numbers, -0.0 before +0.0 as the maximum, a row of equal values."""
    rows = torch.randn(9, width, generator=gen)

    def picks(count: int) -> torch.Tensor:
        return torch.randperm(width, generator=gen)[:min(count, width)]

    rows[1, picks(3)] = 50.0  # ties: the first wins
    rows[2, picks(2)] = float("nan")
    rows[3] = float("-inf")
    rows[4, picks(2)] = float("inf")
    rows[5] = -1.0
    rows[5, picks(2)] = torch.tensor([-0.0, 0.0])[:min(2, width)]
    rows[6] = 3.0
    rows[7, picks(1)] = float("nan")
    rows[7, picks(1)] = float("inf")
    rows[8, -1] = 100.0  # the maximum in the tail
    return rows


@pytest.mark.parametrize("width", [1, 7, 8, 15, 16, 17, 40, 49157])
def test_native_argmax_is_torch_argmax(width):
    gen = torch.Generator().manual_seed(width)
    rows = special_rows(width, gen)
    expected = rows.argmax(dim=-1)
    ours, two = on_thread_counts(lambda: argmax_rows(rows, native=True))
    assert ours.dtype == torch.int64 and torch.equal(ours, expected) and torch.equal(two, expected)
    for i in range(rows.shape[0]):  # one row at a time: the same
        assert argmax_rows(rows[i:i + 1], native=True).item() == expected[i].item()


def test_what_the_kernel_does_not_take_goes_to_torch():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 33, generator=gen)
    for logits in (rows[:, ::2], rows.to(torch.bfloat16), rows[0], rows[:0]):
        assert torch.equal(argmax_rows(logits, native=True), logits.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="out must be contiguous int64"):
        torch.ops.vllm_sampling.argmax_rows(torch.empty(5, dtype=torch.int64), rows)
    with pytest.raises(RuntimeError, match="logits must be contiguous float32"):
        torch.ops.vllm_sampling.argmax_rows(torch.empty(6, dtype=torch.int64), rows.double())


def test_sampler_samples_the_same_with_and_without_the_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 1000, generator=gen) * 3
    with_kernel = Sampler(CPU)
    monkeypatch.setenv("VLLM_USE_TORCH_REFERENCE_OPS", "1")
    without = Sampler(CPU)
    assert with_kernel.native and not without.native
    for temperatures in ([0.0] * 6, [0.0, 0.7, 1.0, 0.0, 1.3, 0.9]):
        results = []
        for sampler in (with_kernel, without):
            generators = {j: torch.Generator().manual_seed(10 + j) for j in range(6)}  # every row seeded
            meta = SamplingMetadata(temperature=torch.tensor(temperatures), top_p=None, top_k=None, min_p=None,
                                    all_greedy=not any(temperatures), generators=generators, max_num_logprobs=None)
            results.append(sampler(logits.clone(), meta)[0])
        greedy = [j for j, t in enumerate(temperatures) if t == 0]
        assert torch.equal(results[0], results[1])
        assert torch.equal(results[0][greedy], logits.argmax(-1)[greedy])
