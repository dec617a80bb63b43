"""AdapterRelay: weights cross to the workers once per adapter in use, refs otherwise, and the
two sides' tables stay equal through finishes, preemptions and returns."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from vllm.core.sched_output import NewRequestData, SchedulerOutput
from vllm.executor.adapter_relay import AdapterRef, AdapterRelay
from vllm.sampling_params import SamplingParams


@dataclass
class FakeAdapter:
    fingerprint: bytes
    payload: bytes = b"x" * 1000


A, B = FakeAdapter(b"a"), FakeAdapter(b"b")


def _new(req_id: str, weights) -> NewRequestData:
    return NewRequestData(req_id, [1, 2], 2, SamplingParams(), [0], 0, None, None, lora_weights=weights)


def _sched(new=(), finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(list(new), [], {r.req_id: 1 for r in new}, len(new), set(finished), set(preempted))


def _step(rank0: AdapterRelay, worker: AdapterRelay, sched: SchedulerOutput) -> tuple[list, SchedulerOutput]:
    packed = rank0.pack(sched)
    sent = [r.lora_weights for r in packed.scheduled_new_reqs]
    received = worker.unpack(pickle.loads(pickle.dumps(packed)))  # as the pipe carries it
    assert [r.lora_weights for r in received.scheduled_new_reqs] == [r.lora_weights for r in sched.scheduled_new_reqs]
    assert len(rank0) == len(worker)
    return sent, packed


def test_weights_cross_once_while_in_use():
    rank0, worker = AdapterRelay(), AdapterRelay()
    original = _sched([_new("1", A), _new("2", A), _new("3", None), _new("4", B)])
    sent, packed = _step(rank0, worker, original)
    assert sent == [A, AdapterRef(b"a"), None, B]  # the second user of A in one step gets a ref
    assert original.scheduled_new_reqs[1].lora_weights is A  # rank 0's own output is untouched
    sent, _ = _step(rank0, worker, _sched([_new("5", A)], finished=["1", "4"]))
    assert sent == [AdapterRef(b"a")] and len(rank0) == 1  # B has no user left: dropped on both sides
    sent, _ = _step(rank0, worker, _sched([_new("6", B)], finished=["2", "5"]))
    assert sent == [B]  # B crosses again; A is gone once its last user finished
    assert len(rank0) == 1


def test_a_preempted_request_brings_its_weights_back_when_nobody_kept_them():
    rank0, worker = AdapterRelay(), AdapterRelay()
    _step(rank0, worker, _sched([_new("1", A)]))
    sent, _ = _step(rank0, worker, _sched(preempted=["1"]))
    assert len(rank0) == 0
    sent, _ = _step(rank0, worker, _sched([_new("1", A)]))
    assert sent == [A]
    sent, _ = _step(rank0, worker, _sched([_new("2", A)], preempted=["1"]))
    assert sent == [A]  # the only user left this step before the new one joined
