"""The scheduler's priority policy, without a model: admission in (priority, arrival)
order, the victim of a preemption is the running request with the largest
(priority, arrival), and FCFS ignores priorities exactly as before."""

from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.kv_cache_utils import make_block_hasher
from vllm.core.request import Request
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams
from tests.core.test_scheduler import BS, run_step


def make_scheduler(policy, num_blocks=64, max_seqs=8, budget=64):
    config = SchedulerConfig(budget, max_seqs, 256, policy=policy)
    return Scheduler(config, CacheConfig(block_size=BS), None, num_blocks)


def make_request(req_id, prompt, priority=0, arrival=0.0, max_tokens=6):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_tokenizer(eos_token_id=0, generation_eos_ids=set())
    return Request(req_id, prompt, sp, max_tokens=max_tokens, arrival_time=arrival, priority=priority,
                   block_hasher=make_block_hasher(BS))


def admitted_order(policy, specs, max_seqs=1):
    """Ids in the order they are first scheduled, one running at a time."""
    sched = make_scheduler(policy, max_seqs=max_seqs)
    for req_id, priority, arrival in specs:
        sched.add_request(make_request(req_id, [1, 2, 3], priority, arrival, max_tokens=1))
    order = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        order += [n.req_id for n in out.scheduled_new_reqs]
    return order


def test_priority_admits_by_priority_then_arrival():
    specs = [("a", 2, 1.0), ("b", 1, 2.0), ("c", 2, 0.5), ("d", 0, 3.0), ("e", 1, 2.0)]
    assert admitted_order("priority", specs) == ["d", "b", "e", "c", "a"]  # equal keys: submission order


def test_fcfs_ignores_priority():
    specs = [("a", 2, 1.0), ("b", 1, 2.0), ("c", 2, 0.5), ("d", 0, 3.0)]
    assert admitted_order("fcfs", specs) == ["a", "b", "c", "d"]


def _two_running_then_pressure(policy, first, second):
    """Two 7-token requests in 4 blocks of 4: the third block each needs forces a preemption."""
    sched = make_scheduler(policy, num_blocks=4)
    sched.add_request(make_request(*first))
    sched.add_request(make_request(*second))
    run_step(sched)
    run_step(sched)
    out, _ = run_step(sched)
    return sched, out


def test_priority_preempts_the_lowest_priority_even_if_older():
    # "old" arrived first but has the larger priority value: it is the victim.
    sched, out = _two_running_then_pressure(
        "priority", ("old", [1, 2, 3, 4, 5, 6, 7], 5, 1.0), ("new", [9, 10, 11, 12, 13, 14, 15], 0, 2.0))
    assert out.preempted_req_ids == {"old"} and "new" in out.num_scheduled_tokens
    assert sched.waiting[0].request_id == "old" and sched.waiting[0].num_computed_tokens == 0


def test_priority_ties_preempt_the_newest():
    sched, out = _two_running_then_pressure(
        "priority", ("old", [1, 2, 3, 4, 5, 6, 7], 1, 1.0), ("new", [9, 10, 11, 12, 13, 14, 15], 1, 2.0))
    assert out.preempted_req_ids == {"new"}


def test_fcfs_preempts_the_newest_whatever_the_priority():
    _, out = _two_running_then_pressure(
        "fcfs", ("old", [1, 2, 3, 4, 5, 6, 7], 5, 1.0), ("new", [9, 10, 11, 12, 13, 14, 15], 0, 2.0))
    assert out.preempted_req_ids == {"new"}


def test_preempted_request_waits_in_priority_order():
    sched = make_scheduler("priority", num_blocks=4, max_seqs=2)
    sched.add_request(make_request("low", [1, 2, 3, 4, 5, 6, 7], 3, 1.0))
    sched.add_request(make_request("high", [9, 10, 11, 12, 13, 14, 15], 0, 2.0))
    run_step(sched)
    sched.add_request(make_request("mid", [20, 21, 22], 1, 3.0))  # waits: max_num_seqs=2
    run_step(sched)
    out, _ = run_step(sched)
    assert out.preempted_req_ids == {"low"}
    assert [r.request_id for r in sched.waiting] == ["mid", "low"]
    finished = []
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        _, outs = run_step(sched)
        finished += [o.request_id for o in outs if o.finished]
    assert finished == ["high", "mid", "low"]
    assert sched.kv_cache_manager.pool.get_num_free_blocks() == 4


def test_token_counters():
    sched = make_scheduler("fcfs")
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    sched.add_request(make_request("b", [4, 5, 6, 7, 8], max_tokens=2))
    while sched.has_unfinished_requests():
        run_step(sched)
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (8, 5)
