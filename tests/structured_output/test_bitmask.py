"""apply_bitmask: only the listed rows change, exactly as the torch reference says."""

from __future__ import annotations

import pytest
import torch

from vllm.structured_output.bitmask import apply_bitmask, apply_bitmask_reference

VOCAB = 203  # not a multiple of 32: the last word is partly padding


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit by bit, from the layout's definition."""
    out = logits.clone()
    for r in rows:
        words = bitmask[r].tolist()
        for t in range(logits.shape[1]):
            if t >= len(words) * 32 or not (words[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("impl", [apply_bitmask, apply_bitmask_reference])
def test_matches_definition_and_leaves_other_rows(dtype, impl):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)).to(dtype)
    bitmask = random_bitmask(8, VOCAB, seed=1)  # more rows than the logits
    rows = [4, 0, 3]
    want = expected(logits, bitmask, rows)
    impl(logits, bitmask, rows)
    assert torch.equal(logits, want)


def test_sign_bit_and_full_words():
    logits = torch.zeros(2, 64)
    bitmask = torch.tensor([[-(2**31), -1], [1, 0]], dtype=torch.int32)  # only bit 31; all
    apply_bitmask(logits, bitmask, [0, 1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31] + list(range(32, 64))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0]


@pytest.mark.parametrize("impl", [apply_bitmask, apply_bitmask_reference])
def test_logits_wider_than_bitmask(impl):
    """Columns the grammar's vocabulary does not cover are disallowed in masked rows only."""
    logits = torch.randn(3, VOCAB + 40)
    before = logits.clone()
    bitmask = torch.full((3, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    impl(logits, bitmask, [1])
    covered = bitmask.shape[1] * 32
    assert torch.isneginf(logits[1, covered:]).all()
    assert torch.equal(logits[1, :covered], before[1, :covered])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    apply_bitmask(logits, torch.zeros(2, 7, dtype=torch.int32), [])
    assert torch.equal(logits, before)


def test_bad_arguments():
    logits = torch.randn(2, VOCAB)
    bitmask = random_bitmask(2, VOCAB, seed=2)
    with pytest.raises(IndexError):
        apply_bitmask(logits, bitmask, [2])
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(logits, bitmask.to(torch.int64), [0])
    with pytest.raises(ValueError, match="2-D"):
        apply_bitmask(logits[0], bitmask, [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    vocab = 49155
    logits = torch.randn(64, vocab + 29, generator=torch.Generator().manual_seed(3)).to(dtype)
    bitmask = random_bitmask(64, vocab, seed=4)
    rows = list(range(0, 64, 3))
    want = logits.clone()
    apply_bitmask_reference(want, bitmask, rows)
    got = logits.cuda()
    apply_bitmask(got, bitmask, rows)  # bitmask stays on the CPU, as the manager fills it
    assert torch.equal(got.cpu(), want)
    ref = logits.cuda()
    apply_bitmask_reference(ref, bitmask.cuda(), rows)
    assert torch.equal(ref.cpu(), want)
