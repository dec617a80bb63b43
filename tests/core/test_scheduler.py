"""Scheduler and KV-cache manager behaviour, without a model: budgets, chunking,
prefix hits, preemption, LoRA limits and stop conditions."""

from vllm.config import CacheConfig, LoRAConfig, SchedulerConfig
from vllm.core.kv_cache_utils import make_block_hasher
from vllm.core.request import Request, RequestStatus
from vllm.core.scheduler import Scheduler
from vllm.core.sched_output import ModelRunnerOutput
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, caching=True, max_loras=0, max_model_len=256,
                   long_prefill_token_threshold=0):
    lora = LoRAConfig(max_loras=max_loras) if max_loras else None
    config = SchedulerConfig(budget, max_seqs, max_model_len, long_prefill_token_threshold=long_prefill_token_threshold)
    return Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=caching), lora, num_blocks)


def make_request(req_id, prompt, max_tokens=4, lora=None, alora_start=None, **params):
    sp = SamplingParams(max_tokens=max_tokens, **params)
    sp.update_from_tokenizer(eos_token_id=0, generation_eos_ids=set())
    return Request(req_id, prompt, sp, max_tokens=max_tokens, lora_request=lora,
                   alora_invocation_start=alora_start, block_hasher=make_block_hasher(BS))


def run_step(sched, token=7):
    """Schedule, pretend the model ran (sampling `token` for requests at their end)."""
    out = sched.schedule()
    req_ids, sampled = [], []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        req_ids.append(rid)
        sampled.append([token] if req.num_computed_tokens == req.num_tokens else [])
    return out, sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))


def test_budget_splits_prompts_and_mixes_decodes():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", list(range(1, 9))))  # 8 tokens
    sched.add_request(make_request("b", list(range(101, 113))))  # 12 tokens
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 8, "b": 2}
    out, outputs = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}  # a decodes, b's chunk continues
    assert [o.request_id for o in outputs] == ["a"]
    out, outputs = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert {o.request_id for o in outputs} == {"a", "b"}


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), [1, 2, 3]))
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"0", "1"} and len(sched.waiting) == 1


def test_stop_conditions():
    sched = make_scheduler()
    sched.add_request(make_request("len", [1, 2, 3], max_tokens=2, ignore_eos=True))
    sched.add_request(make_request("eos", [1, 2, 3], max_tokens=5))
    sched.add_request(make_request("min", [1, 2, 3], max_tokens=5, min_tokens=2))
    sched.add_request(make_request("stop_id", [1, 2, 3], max_tokens=5, stop_token_ids=[0]))
    _, outs = run_step(sched, token=0)  # token 0 is EOS
    done = {o.request_id: (o.finish_reason, o.stop_reason) for o in outs if o.finished}
    assert done == {"eos": ("stop", None), "stop_id": ("stop", 0)}
    _, outs = run_step(sched, token=0)
    done = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert done == {"len": "length", "min": "stop"}  # ignore_eos: only the length stops it
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.pool.get_num_free_blocks() == 64


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=6)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=100))
    outs = []
    while sched.has_unfinished_requests():
        outs += run_step(sched)[1]
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 2


def test_same_step_prefix_hit():
    """A request admitted in the same step as another with a shared prefix hits the
    blocks the first one is computing in this very step."""
    sched = make_scheduler()
    sched.add_request(make_request("a", list(range(1, 9))))
    sched.add_request(make_request("b", list(range(1, 13))))
    out, _ = run_step(sched)
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 8]
    assert out.scheduled_new_reqs[1].block_ids[:2] == out.scheduled_new_reqs[0].block_ids


def test_prefix_cache_hit_and_last_token_recomputed():
    sched = make_scheduler()
    prompt = list(range(1, 13))  # exactly 3 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("b", prompt + [50, 51], max_tokens=1))
    out, _ = run_step(sched)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12 and out.num_scheduled_tokens["b"] == 2
    # Same prompt again: the hit stops one block short so the last token is computed.
    sched.add_request(make_request("c", prompt, max_tokens=1))
    out, outs = run_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8 and outs[0].num_cached_tokens == 8
    stats = sched.kv_cache_manager.stats
    assert stats.hits == 20 and stats.queries == 12 + 14 + 12


def test_no_prefix_caching_means_no_hits():
    sched = make_scheduler(caching=False)
    for rid in "ab":
        sched.add_request(make_request(rid, list(range(1, 13)), max_tokens=1))
        out, _ = run_step(sched)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_preemption_of_newest_and_recompute():
    sched = make_scheduler(num_blocks=4, budget=64)  # 16 token slots
    sched.add_request(make_request("old", [1, 2, 3, 4, 5, 6, 7], max_tokens=6))  # 2 blocks
    sched.add_request(make_request("new", [9, 10, 11, 12, 13, 14, 15], max_tokens=6))  # 2 blocks
    run_step(sched)
    run_step(sched)  # both at 8 tokens + 1 computed -> need a 3rd block each
    out, _ = run_step(sched)
    assert out.preempted_req_ids == {"new"} and "new" not in out.num_scheduled_tokens
    assert sched.waiting[0].request_id == "new" and sched.waiting[0].num_computed_tokens == 0
    finished = set()
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        out, outs = run_step(sched)
        finished |= {o.request_id for o in outs if o.finished}
        resumed = [n for n in out.scheduled_new_reqs if n.req_id == "new"]
        if resumed:  # comes back with all its tokens, prompt and outputs
            assert len(resumed[0].token_ids) > 7
    assert finished == {"old", "new"}
    assert sched.kv_cache_manager.pool.get_num_free_blocks() == 4


def test_max_loras_per_step():
    sched = make_scheduler(max_loras=1)
    l1, l2 = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    sched.add_request(make_request("x", [1, 2], lora=l1))
    sched.add_request(make_request("y", [1, 2], lora=l2))
    sched.add_request(make_request("z", [1, 2], lora=l1))
    sched.add_request(make_request("base", [1, 2]))
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"x", "z", "base"}
    assert [r.request_id for r in sched.waiting] == ["y"]


def test_abort_frees_blocks():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", list(range(1, 10))))
    sched.add_request(make_request("b", list(range(1, 10))))
    run_step(sched)
    sched.finish_requests(["a", "b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.pool.get_num_free_blocks() == 8
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty


def test_alora_reuses_base_blocks():
    sched = make_scheduler(max_loras=2)
    conversation = list(range(1, 18))  # 17 tokens: 4 full blocks
    sched.add_request(make_request("base", conversation, max_tokens=1))
    run_step(sched)
    alora = LoRARequest("alora", 3, "/c")
    sched.add_request(make_request("al", conversation + [90, 91], lora=alora, alora_start=17))
    out, _ = run_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert sched.kv_cache_manager.stats.alora_reused == 16
    sched.add_request(make_request("plain", conversation + [90, 91], lora=LoRARequest("p", 4, "/p")))
    out, _ = run_step(sched)
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs if n.req_id == "plain"] == [0]


def test_long_prefill_token_threshold_caps_each_request_per_step():
    """A long prompt is chunked at the threshold even with budget to spare, so a short
    request arriving behind it (an intrinsic over a cached conversation) runs at once."""
    sched = make_scheduler(budget=64, long_prefill_token_threshold=12)
    sched.add_request(make_request("long", list(range(1, 41))))  # 40 tokens
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"long": 12}
    sched.add_request(make_request("short", [201, 202, 203]))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"long": 12, "short": 3}
    out, outputs = run_step(sched)
    assert out.num_scheduled_tokens == {"long": 12, "short": 1}  # decodes are never capped below 1
    out, outputs = run_step(sched)
    assert out.num_scheduled_tokens == {"long": 4, "short": 1}
    assert {o.request_id for o in outputs} == {"long", "short"}


def test_without_threshold_a_long_prompt_takes_the_whole_budget():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("long", list(range(1, 41))))
    run_step(sched)
    sched.add_request(make_request("short", [201, 202, 203]))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"long": 16}
