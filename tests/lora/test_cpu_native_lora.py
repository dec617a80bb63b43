"""The native CPU LoRA op (vllm/csrc/cpu/lora_runs.cpp) against the torch op on a layer's stacked
slots: fp32 and bf16, ranks padded below max_rank, features and columns off any vector width; rows
without an adapter untouched; a token's result the same alone or in a batch and on any thread
count; clear errors for bad runs; and LinearWithLoRA holding B once, transposed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.lora.layers import LinearWithLoRA
from vllm.lora.lora_model import LoRALayerWeights
from vllm.lora.ops import cpu_native, torch_ops
from vllm.lora.punica import PunicaWrapper
from vllm.model_executor.layers.linear import Linear

pytestmark = pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="native LoRA kernel not built")

IN_FEATURES = 40
SLICES = [48, 16, 21]  # qkv-like, the last off the 16-column vectors
MAX_LORAS, MAX_RANK = 4, 8
SLOT_RANKS = [8, 4, 2, 0]  # slot 3: an adapter that does not target this layer


def stacked_weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """a [S, 3R, K] (slices' A stacked), b [S, N, 3R] block-diagonal, as layers.py stores them."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.zeros(MAX_LORAS, MAX_RANK * len(SLICES), IN_FEATURES)
    b = torch.zeros(MAX_LORAS, sum(SLICES), MAX_RANK * len(SLICES))
    for slot, r in enumerate(SLOT_RANKS):
        off = 0
        for i, n in enumerate(SLICES):
            a[slot, i * MAX_RANK : i * MAX_RANK + r] = torch.randn(r, IN_FEATURES, generator=gen) * 0.3
            b[slot, off : off + n, i * MAX_RANK : i * MAX_RANK + r] = torch.randn(n, r, generator=gen) * 0.3
            off += n
    return a.to(dtype), b.to(dtype)


def blocks() -> list[int]:
    out, off = [], 0
    for i, n in enumerate(SLICES):
        out += [off, n, i * MAX_RANK, MAX_RANK]
        off += n
    return out


def meta_of(mapping: list[int]):
    punica = PunicaWrapper(max_num_tokens=len(mapping) + 8, device=torch.device("cpu"))
    punica.update(np.array(mapping, dtype=np.int64))
    return punica.meta


def both(mapping: list[int], dtype: torch.dtype, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    a, b = stacked_weights(dtype)
    meta = meta_of(mapping)
    x = torch.randn(len(mapping), IN_FEATURES, generator=gen).to(dtype)
    y = torch.randn(len(mapping), sum(SLICES), generator=gen).to(dtype)
    expected = y.clone()
    torch_ops.add_lora(expected, x, [a], [b], (sum(SLICES),), meta)
    got = y.clone()
    cpu_native.add_lora_runs(got, x, a, b.transpose(1, 2).contiguous(), blocks(), meta)
    return y, got, expected


@pytest.mark.parametrize("mapping", [
    [0, 0, 0, 1, 1, -1, -1, 2, 2, 2, 3, 3],  # runs of several slots, base rows between
    [1],  # a decode row
    [-1] * 5 + [0] * 16,  # an aLoRA step: base rows, then the adapted ones
])
def test_native_op_matches_the_torch_op_in_fp32(mapping):
    y, got, expected = both(mapping, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    base = [t for t, s in enumerate(mapping) if s < 0]
    assert torch.equal(got[base], y[base])
    unadapted = [t for t, s in enumerate(mapping) if s == 3]  # slot 3 holds zeros: y exactly as it was
    assert torch.equal(got[unadapted], y[unadapted])


def test_native_op_matches_the_torch_op_in_bf16():
    mapping = [-1, -1, 0, 0, 0, 0, 1, 1, 2, 2, 2]
    y, got, expected = both(mapping, torch.bfloat16)
    # Both round h to bf16 and y once; the sums' orders differ, so at most a bf16 rounding step apart.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 * 2**-8, atol=1e-2)
    assert torch.equal(got[:2], y[:2])
    assert not torch.equal(got[2:], y[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_result_does_not_depend_on_the_batch_or_threads(dtype):
    a, b = stacked_weights(dtype)
    b_t = b.transpose(1, 2).contiguous()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, IN_FEATURES, generator=gen).to(dtype)
    y = torch.randn(9, sum(SLICES), generator=gen).to(dtype)

    def native(rows: int) -> torch.Tensor:
        out = y[:rows].clone()
        cpu_native.add_lora_runs(out, x[:rows], a, b_t, blocks(), meta_of([0] * rows))
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, alone = native(9), native(1)
        torch.set_num_threads(2)
        two = native(9)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], alone[0]) and torch.equal(one, two)


def test_bad_runs_and_shapes_get_clear_errors():
    a, b = stacked_weights(torch.float32)
    b_t = b.transpose(1, 2).contiguous()
    x, y = torch.randn(4, IN_FEATURES), torch.randn(4, sum(SLICES))
    with pytest.raises(RuntimeError, match="outside 4 slots and 4 tokens"):
        torch.ops.vllm_lora.add_lora_runs(y, x, a, b_t, blocks(), [0, 2, 6])
    with pytest.raises(RuntimeError, match="outside 85 columns"):
        torch.ops.vllm_lora.add_lora_runs(y, x, a, b_t, [80, 16, 0, 8], [0, 0, 4])
    with pytest.raises(RuntimeError, match="must be Float like x"):
        torch.ops.vllm_lora.add_lora_runs(y, x, a.to(torch.bfloat16), b_t, blocks(), [0, 0, 4])


def test_layer_holds_b_once_transposed():
    base = Linear(IN_FEATURES, SLICES, bias=False, dtype=torch.float32, device=torch.device("cpu"))
    base.weight.data.normal_()
    punica = PunicaWrapper(max_num_tokens=16, device=torch.device("cpu"))
    layer = LinearWithLoRA(base, MAX_LORAS, MAX_RANK, punica)
    assert layer.lora_b_t is not None and layer.stacked
    gen = torch.Generator().manual_seed(1)
    weights = LoRALayerWeights(lora_a=[torch.randn(4, IN_FEATURES, generator=gen), None, torch.randn(4, IN_FEATURES)],
                               lora_b=[torch.randn(48, 4, generator=gen), None, torch.randn(21, 4)])
    layer.set_lora(2, weights)
    assert layer.lora_b[0].data_ptr() == layer.lora_b_t.data_ptr()  # one copy of B, seen both ways
    assert torch.equal(layer.lora_b_t[2, :4, :48], weights.lora_b[0].T)
    assert torch.equal(layer.lora_b_t[2, 16:20, 64:85], weights.lora_b[2].T) and not layer.lora_b_t[2, 8:16].any()
    punica.update(np.array([-1, 2, 2, 2]))
    assert cpu_native.runs_native(punica.meta, torch.float32)  # the native op, not the torch fallback
    x = torch.randn(4, IN_FEATURES, generator=gen)
    native = layer(x)
    reference = base.forward_local(x)
    torch_ops.add_lora(reference, x, layer.lora_a, layer.lora_b, layer._op_slices, punica.meta)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
    assert not torch.equal(native[1:], base.forward_local(x)[1:])
    layer.set_lora(2, None)  # the slot emptied: B^T too
    assert not layer.lora_b_t[2].any()
    torch.testing.assert_close(layer(x), base.forward_local(x), rtol=0, atol=0)


def test_many_tokens_and_gathered_groups_take_the_torch_path():
    for dtype, limit in cpu_native.NATIVE_MAX_TOKENS.items():
        assert cpu_native.runs_native(meta_of([-1] * 3 + [0] * limit), dtype)
        assert not cpu_native.runs_native(meta_of([0] * (limit + 1)), dtype)
    fragmented = meta_of([0, 1, 0, 1, -1, 2, 0, 2, 1, 0, 1, 0, 1, 0, 1, 0])  # gathered groups
    assert not cpu_native.runs_native(fragmented, torch.bfloat16)
    assert not cpu_native.runs_native(meta_of([-1, -1]), torch.bfloat16)
    assert not cpu_native.runs_native(meta_of([0]), torch.float16)
