"""Triton multi-LoRA op vs the torch reference (run by the Triton interpreter on CPU):
both variants (SGMV, BGMV), with and without split-K, fused slices of different sizes,
ranks padded below max_rank, and -1 rows that must stay bit-for-bit untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.lora.ops import torch_ops, triton_ops
from vllm.lora.punica import LoRAKernelMeta, PunicaWrapper

IN_FEATURES = 40  # not a multiple of any block size: exercises the k masks
SLICES = [48, 16, 24]  # fused qkv-like slices of different widths
MAX_LORAS, MAX_RANK = 4, 8
SLOT_RANKS = [8, 4, 2, 0]  # slot 3 holds no adapter (all zeros)


def make_weights(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lora_a, lora_b = [], []
    for n in SLICES:
        a = torch.zeros(MAX_LORAS, MAX_RANK, IN_FEATURES)
        b = torch.zeros(MAX_LORAS, n, MAX_RANK)
        for slot, r in enumerate(SLOT_RANKS):
            a[slot, :r] = torch.randn(r, IN_FEATURES, generator=gen) * 0.3
            b[slot, :, :r] = torch.randn(n, r, generator=gen) * 0.3
        lora_a.append(a.to(dtype))
        lora_b.append(b.to(dtype))
    return lora_a, lora_b


def make_meta(mapping: list[int]) -> LoRAKernelMeta:
    punica = PunicaWrapper(max_num_tokens=len(mapping) + 8, device=torch.device("cpu"))
    punica.update(np.array(mapping, dtype=np.int64))
    return punica.meta


def random_mapping(num_tokens: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    mapping = rng.integers(-1, 3, size=num_tokens)  # slots 0..2 and -1, interleaved
    mapping[:3] = [-1, 2, 3]  # slot 3: an adapter that does not target this layer (zeros)
    return mapping.tolist()


def run_both(mapping, dtype=torch.float32, pad_rows=0, **kwargs):
    gen = torch.Generator().manual_seed(7)
    n = len(mapping)
    lora_a, lora_b = make_weights(dtype)
    meta = make_meta(mapping)
    x = torch.randn(n + pad_rows, IN_FEATURES, generator=gen).to(dtype)
    # y is a column slice of a wider buffer: strides must be honoured, neighbours untouched.
    buf = torch.randn(n + pad_rows, sum(SLICES) + 10, generator=gen).to(dtype)
    y = buf[:, 4 : 4 + sum(SLICES)]
    expected = buf.clone()
    torch_ops.add_lora(expected[:, 4 : 4 + sum(SLICES)], x, lora_a, lora_b, SLICES, meta)
    before = buf.clone()
    triton_ops.add_lora(y, x, lora_a, lora_b, SLICES, meta, **kwargs)
    return before, buf, expected


@pytest.mark.parametrize("sgmv", [True, False])
@pytest.mark.parametrize("split_k", [1, 2])
def test_add_lora_matches_reference(sgmv, split_k):
    mapping = random_mapping(37, seed=1)
    before, out, expected = run_both(mapping, pad_rows=3, sgmv=sgmv, split_k=split_k)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    untouched = torch.tensor([s < 0 for s in mapping] + [True] * 3)
    assert torch.equal(out[untouched], before[untouched])  # -1 and padding rows: bit-identical
    assert torch.equal(out[:, :4], before[:, :4]) and torch.equal(out[:, -6:], before[:, -6:])
    assert not torch.equal(out[~untouched], before[~untouched])  # the adapters really did something


@pytest.mark.parametrize("sgmv", [True, False])
def test_half_precision(sgmv):
    """fp16 stands in for bf16 (the interpreter cannot run tl.dot on bf16)."""
    mapping = random_mapping(21, seed=2)
    before, out, expected = run_both(mapping, dtype=torch.float16, sgmv=sgmv)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    untouched = torch.tensor([s < 0 for s in mapping])
    assert torch.equal(out[untouched], before[untouched])


@pytest.mark.parametrize("sgmv", [True, False, None])
def test_no_adapted_tokens_is_a_no_op(sgmv):
    before, out, expected = run_both([-1] * 9, sgmv=sgmv)
    assert torch.equal(out, before) and torch.equal(expected, before)


def test_single_adapter_every_token():
    before, out, expected = run_both([1] * 70)  # one segment covering the whole batch
    assert triton_ops.use_sgmv(make_meta([1] * 70), out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_variant_choice_by_token_count():
    small = make_meta(random_mapping(triton_ops.BGMV_MAX_TOKENS, seed=3))
    large = make_meta(random_mapping(triton_ops.BGMV_MAX_TOKENS + 1, seed=3))
    x = torch.zeros(1)
    assert not triton_ops.use_sgmv(small, x)
    assert triton_ops.use_sgmv(large, x)


def test_bgmv_from_persistent_mapping_only():
    """Under CUDA-graph replay only the persistent mapping buffer is fresh: a meta
    without segment tensors must still apply every adapter through BGMV."""
    mapping = random_mapping(12, seed=4)
    full = make_meta(mapping)
    graph_meta = LoRAKernelMeta(num_tokens=full.num_tokens, token_lora_mapping=full.token_lora_mapping)
    gen = torch.Generator().manual_seed(9)
    lora_a, lora_b = make_weights()
    x = torch.randn(12, IN_FEATURES, generator=gen)
    y = torch.randn(12, sum(SLICES), generator=gen)
    expected = y.clone()
    torch_ops.add_lora(expected, x, lora_a, lora_b, SLICES, full)
    triton_ops.add_lora(y, x, lora_a, lora_b, SLICES, graph_meta)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
