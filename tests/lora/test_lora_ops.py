"""The torch multi-LoRA op against a per-token definition, for contiguous runs and
for fragmented mappings; -1 rows stay bit-identical."""

import numpy as np
import pytest
import torch

from vllm.lora.ops.torch_ops import add_lora
from vllm.lora.punica import PunicaWrapper


def naive(y, x, lora_a, lora_b, mapping):
    out = y.clone()
    for t, slot in enumerate(mapping):
        if slot < 0:
            continue
        parts = [(x[t] @ a[slot].T) @ b[slot].T for a, b in zip(lora_a, lora_b)]
        out[t] += torch.cat(parts)
    return out


@pytest.mark.parametrize("mapping, path", [
    ([0, 0, 0, 1, 1, -1, -1, 2, 2, 2, 2, 2], "runs"),
    ([-1] * 12, None),  # nothing adapted
    ([0, 1, 0, 1, -1, 2, 0, 2, 1, 0, 1, 0, 1, 0, 1, 0], "groups"),  # fragmented: gather path
    ([1] * 12, "runs"),  # one adapter everywhere
])
def test_torch_op_matches_definition(mapping, path):
    torch.manual_seed(0)
    sizes = (12, 4, 4)
    x, y = torch.randn(len(mapping), 8), torch.randn(len(mapping), sum(sizes))
    lora_a = [torch.randn(3, 5, 8) for _ in sizes]
    lora_b = [torch.randn(3, n, 5) for n in sizes]
    punica = PunicaWrapper(32, torch.device("cpu"))
    punica.update(np.array(mapping))
    expected = naive(y, x, lora_a, lora_b, mapping)
    got = y.clone()
    if punica.meta.has_lora:
        add_lora(got, x, lora_a, lora_b, sizes, punica.meta)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    base_rows = [t for t, s in enumerate(mapping) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])
    assert bool(punica.meta.runs) == (path == "runs") and bool(punica.meta.groups) == (path == "groups")
