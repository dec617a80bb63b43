"""The runner's step inputs (vllm/worker/input_batch.py): a step of one token per request takes
a path of its own (Python ints instead of the vectorised pass), which must give the same arrays,
dtypes included, as the vectorised pass on every kind of one-token row: decodes that sample,
one-token chunks of a prompt (no sample; prompt logprobs wanted or not), block sizes that do and
do not divide the positions, plain LoRA and aLoRA rows before and after their invocation, and
rows routed by control tokens (Granite Switch). No model needed."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vllm.lora.control_tokens import ControlTokenRouter
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.worker import input_batch
from vllm.worker.input_batch import CachedRequestState, build_step_inputs

VOCAB = 50
CONTROL = {47: 0, 48: 1, 49: 2}  # reset, adapter 1, adapter 2


def one_token_states(rng: random.Random, count: int, block_size: int, with_lora: bool) -> list[CachedRequestState]:
    states = []
    for i in range(count):
        num_prompt = rng.randint(1, 40)
        total = num_prompt + rng.randint(0, 30)
        tokens = [rng.randrange(VOCAB) for _ in range(total)]
        computed = rng.randint(0, total - 1)  # the step computes position `computed`
        blocks = rng.sample(range(1, 500), (computed + block_size) // block_size + rng.randint(0, 2))
        lora, start = None, None
        if with_lora and rng.random() < 0.7:
            lora = LoRARequest(f"a{i % 3}", 1 + i % 3, "/unused")
            start = rng.choice([None, rng.randint(0, total)])  # an aLoRA's invocation start, or plain LoRA
        params = SamplingParams(max_tokens=8, prompt_logprobs=rng.choice([None, 0, 2]))
        states.append(CachedRequestState(
            req_id=f"r{i}", token_ids=tokens, num_prompt_tokens=num_prompt, sampling_params=params,
            block_ids=blocks, num_computed_tokens=computed, lora_request=lora, alora_invocation_start=start,
            generator=None))
    return states


def assert_same_inputs(fast, general) -> None:
    for name, value in vars(general).items():
        other = getattr(fast, name)
        if isinstance(value, np.ndarray):
            assert other.dtype == value.dtype and np.array_equal(other, value), name
        else:
            assert other == value, name


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("adapters", ["none", "lora", "router"])
def test_one_token_steps_match_the_vectorised_pass(block_size, adapters):
    rng = random.Random(block_size * 7 + len(adapters))
    for count in (1, 2, 7):
        states = one_token_states(rng, count, block_size, with_lora=adapters != "none")
        lora_slots = {1: 0, 2: 1, 3: 2} if adapters != "none" else None
        router = ControlTokenRouter(VOCAB, CONTROL) if adapters == "router" else None
        for state in states:
            if router is not None and rng.random() < 0.5:
                state.token_ids[rng.randrange(len(state.token_ids))] = rng.choice(list(CONTROL))
        fast = build_step_inputs(states, [1] * count, block_size, lora_slots, router)
        general = input_batch._any_token_counts(states, [1] * count, block_size, lora_slots, router)
        assert_same_inputs(fast, general)
        assert fast.num_decodes == count and fast.query_start_loc.tolist() == list(range(count + 1))


def test_steps_with_more_tokens_take_the_vectorised_pass():
    """A batch with a chunk of several tokens is not one token each: the general pass runs, and a
    row's one-token arrays are the same in it."""
    rng = random.Random(3)
    states = one_token_states(rng, 3, 16, with_lora=False)
    states[2].num_computed_tokens = 0
    states[2].sampling_params = SamplingParams(max_tokens=8)
    steps = [1, 1, min(4, len(states[2].token_ids))]
    mixed = build_step_inputs(states, steps, 16, None)
    alone = build_step_inputs(states[:2], [1, 1], 16, None)
    assert mixed.num_decodes == 2 and mixed.positions[:2].tolist() == alone.positions.tolist()
    assert mixed.slot_mapping[:2].tolist() == alone.slot_mapping.tolist()
    assert mixed.input_ids[:2].tolist() == alone.input_ids.tolist()
