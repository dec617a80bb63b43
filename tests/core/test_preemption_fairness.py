"""Liveness and fairness of the scheduler under a far oversubscribed KV cache, without a model.

What is shown, for both policies (fcfs and priority):
- every request finishes, within sum(prompt + max_tokens) steps: the oldest unfinished request
  (smallest (priority, arrival) under priority) gains a token every step and is never preempted;
- a preemption's victim is always the newest running request, never an older one while a newer
  one runs, and no request is admitted in a step that preempted;
- requests of equal lengths finish in arrival (sort-key) order;
- with max_num_seqs saturated, requests are admitted in arrival order.
"""

from __future__ import annotations

import random

import pytest

from tests.core.test_scheduler import BS, run_step
from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.kv_cache_utils import cdiv, make_block_hasher
from vllm.core.request import Request
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


def make_scheduler(policy: str, num_blocks: int, budget: int = 64, max_seqs: int = 16) -> Scheduler:
    config = SchedulerConfig(budget, max_seqs, MAX_MODEL_LEN, policy=policy)
    return Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=True), None, num_blocks)


def make_request(req_id: str, prompt: list[int], max_tokens: int, arrival: float, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_tokenizer(eos_token_id=0, generation_eos_ids=set())
    return Request(req_id, prompt, params, max_tokens=max_tokens, arrival_time=arrival, priority=priority,
                   block_hasher=make_block_hasher(BS))


def drive(sched: Scheduler, requests: list[Request], max_steps: int) -> dict[str, int]:
    """Run to completion, checking the victim rule every step; returns request id -> finish step."""
    for request in requests:
        sched.add_request(request)
    finished: dict[str, int] = {}
    for step in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        before = list(sched.running)
        oldest = min((r.sort_key for r in before), default=None)
        out, outputs = run_step(sched)
        assert out.total_num_scheduled_tokens > 0, f"step {step} scheduled nothing: a stall"
        if out.preempted_req_ids:
            assert not out.scheduled_new_reqs, "a request was admitted in a step that preempted"
            victims = [r for r in before if r.request_id in out.preempted_req_ids]
            still_running = [r.sort_key for r in sched.running]
            for victim in victims:
                # The victim is newer than every request that keeps running ...
                assert all(key < victim.sort_key for key in still_running), (victim, sched.running)
                # ... and the oldest is never one while another request runs.
                assert victim.sort_key != oldest or len(before) == 1
        finished.update({o.request_id: step for o in outputs if o.finished})
    raise AssertionError(f"not finished within {max_steps} steps: {sched.running} {list(sched.waiting)}")


def step_bound(requests: list[Request]) -> int:
    """The oldest unfinished request gains at least one token per step and is never a victim."""
    return sum(r.num_prompt_tokens + r.max_tokens for r in requests) + 1


def workload(num: int, seed: int, equal: bool = False, priorities: bool = False) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        length = 9 if equal else rng.randint(3, 14)
        max_tokens = 12 if equal else rng.randint(1, MAX_MODEL_LEN - length)
        # Distinct first tokens: no request hits another's blocks, only its own after a preemption.
        prompt = [100 + i] + [rng.randint(1, 99) for _ in range(length - 1)]
        priority = rng.randint(0, 3) if priorities else 0
        requests.append(make_request(f"r{i}", prompt, max_tokens, arrival=float(i), priority=priority))
    return requests


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oversubscribed_cache_every_request_finishes(policy, seed):
    # 8 blocks = 32 tokens = one max_model_len request; 24 requests of up to 32 tokens each.
    sched = make_scheduler(policy, num_blocks=cdiv(MAX_MODEL_LEN, BS))
    requests = workload(24, seed, priorities=policy == "priority")
    finished = drive(sched, requests, step_bound(requests))
    assert set(finished) == {r.request_id for r in requests}
    assert sched.num_preemptions > 0, "the workload should have forced preemptions"
    for request in requests:
        assert request.num_output_tokens == request.max_tokens
    assert sched.kv_cache_manager.pool.get_num_free_blocks() == sched.kv_cache_manager.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("budget", [64, 5])
def test_equal_requests_finish_in_arrival_order(policy, budget):
    sched = make_scheduler(policy, num_blocks=12, budget=budget)
    requests = workload(16, seed=3, equal=True, priorities=policy == "priority")
    finished = drive(sched, requests, step_bound(requests))
    assert sched.num_preemptions > 0
    by_key = sorted(requests, key=lambda r: r.sort_key)
    steps = [finished[r.request_id] for r in by_key]
    assert steps == sorted(steps), list(zip([r.request_id for r in by_key], steps))


def test_victim_is_newest_even_when_admission_order_differs_from_arrival():
    """Under fcfs `running` stays in arrival order, whatever order requests were admitted in."""
    sched = make_scheduler("fcfs", num_blocks=6)
    late = make_request("late", [1, 2, 3, 4, 5], max_tokens=12, arrival=2.0)
    early = make_request("early", [6, 7, 8, 9, 10], max_tokens=12, arrival=1.0)
    sched.add_request(late)  # submitted first but arrived later
    sched.add_request(early)
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["early", "late"]
    preempted = set()
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        preempted |= out.preempted_req_ids
    assert preempted == {"late"}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_max_num_seqs_admits_in_arrival_order(policy):
    sched = make_scheduler(policy, num_blocks=64, max_seqs=2)
    rng = random.Random(4)
    requests = [make_request(f"q{i}", [1 + i] * rng.randint(2, 9), rng.randint(1, 6), arrival=float(i))
                for i in range(8)]
    for request in requests:
        sched.add_request(request)
    admitted = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        admitted += [n.req_id for n in out.scheduled_new_reqs]
        assert len(sched.running) <= 2
    assert admitted == [r.request_id for r in requests]
