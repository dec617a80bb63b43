"""benchmarks/pipeline_floor.py: the floor ratio of plain-LoRA to aLoRA pipelines moves the
way the physics says (batching shares weight reads, a longer answer is shared cost), and
the aLoRA's intrinsic prefill covers only what is not cached."""

from __future__ import annotations

import pytest

from benchmarks.pipeline_floor import round_floor
from tests.benchmarks.test_alora_pipeline import FakeFloor


def ratio(concurrency, answer_len):
    args = dict(context_len=1000, num_intrinsics=3, intrinsic_len=4, invocation_len=6, block_size=16)
    lora = round_floor(FakeFloor(), "lora", concurrency, answer_len=answer_len, **args)
    alora = round_floor(FakeFloor(), "alora", concurrency, answer_len=answer_len, **args)
    return lora / alora


def test_ratio_grows_with_batching_and_shrinks_with_the_answer():
    assert ratio(8, 32) > ratio(1, 32) > 1.0
    assert ratio(8, 16) > ratio(8, 128) > 1.0


def test_alora_intrinsic_prefills_only_past_the_last_cached_block():
    # One conversation, a 1-token answer and no intrinsics' decode: the difference between the
    # modes is the intrinsics' prefill, 3 x (1007 - 992) tokens against 3 x 1007.
    args = dict(context_len=1000, answer_len=1, num_intrinsics=3, intrinsic_len=1, invocation_len=6, block_size=16)
    base = 1000 / 1000
    assert round_floor(FakeFloor(), "alora", 1, **args) == pytest.approx(base + 3 * 15 / 1000)
    assert round_floor(FakeFloor(), "lora", 1, **args) == pytest.approx(base + 3 * 1007 / 1000)
