"""`Scheduler`: continuous batching under a token budget. Pure Python, no device code.

Each step it advances requests' `num_computed_tokens` under `max_num_batched_tokens`
and `max_num_seqs`. Prefill, chunked prefill and decode are the same thing to it: a
request needs `num_tokens - num_computed_tokens` more tokens computed, of which it gets at
most the remaining budget and, when set, `long_prefill_token_threshold`. Policy:

- Running requests first, oldest first (`running` is kept in arrival order). When
  blocks run out, the newest running request is preempted (its blocks freed,
  recomputed later from the front of the waiting queue). No new request is admitted
  in a step that preempted.
- Then waiting requests FCFS, reusing their longest cached prefix. A request whose
  adapter would exceed `max_loras` distinct adapters in the step is skipped (it
  keeps its place) and later ones may go.
- One `lora_int_id` means one set of weights per step (the runner maps ids to slots): a
  request whose id is already in the step with other weights (`Request.adapter_identity`,
  e.g. the id was reused after `remove_lora` while old requests still run) sits the step
  out, running or waiting, keeping its place. The older weights' requests are ahead, so
  they finish and the newer ones then run.
- A request finishes on a stop token (after `min_tokens`), at `max_tokens`, at
  `max_model_len`, when its grammar terminates, or when aborted.

Under `policy="priority"` "newest" and "FCFS" mean "largest (priority, arrival time)" and
"smallest first": `waiting` and `running` are both kept sorted by `Request.sort_key`, so
the front of `waiting` is the next admitted and the end of `running` the next victim.
Everything else is the same code path; under "fcfs" the order is plain arrival order.

Liveness (tests/core/test_preemption_fairness.py): the engine guarantees that one
request of `max_model_len` tokens fits in the cache, and the front of `running` is scheduled
first every step and is never a victim while another request runs, so it gains at least one
token per step and finishes; nothing stalls and the oldest request is never starved.

It also counts prompt tokens (once per request, at its first sampled token) and generated
tokens for the engine's statistics.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterable, Optional

from vllm.config import CacheConfig, LoRAConfig, SchedulerConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.request import Request, RequestStatus
from vllm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        lora_config: Optional[LoRAConfig],
        num_blocks: int,
        structured_output_manager=None,
    ):
        self.config = scheduler_config
        self.max_loras = lora_config.max_loras if lora_config else 0
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.structured_output_manager = structured_output_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self._new_block_ids: list[int] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._by_priority = scheduler_config.policy == "priority"
        # The latest schedule() result: what a step that fails had scheduled.
        self.last_output: Optional[SchedulerOutput] = None

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self._enqueue(self.waiting, request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Abort (or otherwise finish) requests from outside the step loop."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        self._new_block_ids: list[int] = []
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        step_adapters: dict[int, object] = {}  # lora_int_id -> adapter identity scheduled this step

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if _other_weights(request, step_adapters):
                index += 1
                continue
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            self._new_block_ids.extend(b.block_id for b in new_blocks)
            cached_reqs.append(
                CachedRequestData(request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens)
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if request.lora_int_id:
                step_adapters[request.lora_int_id] = request.adapter_identity
            index += 1

        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs, step_adapters)

        for request_id, n in num_scheduled.items():
            self.requests[request_id].num_computed_tokens += n
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            new_block_ids=self._new_block_ids,
        )
        self._finished_req_ids = set()
        self._fill_grammar_bitmask(output)
        self.last_output = output
        return output

    def discard_step(self, sched: SchedulerOutput) -> None:
        """`sched` failed to run: forget the prefix-cache entries of the blocks it was to fill
        (their KV was never written). Its requests cannot go on and must be aborted."""
        for req_id, num_new in sched.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                self.kv_cache_manager.uncache_from(request, request.num_computed_tokens - num_new)

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                          step_adapters: dict[int, object]) -> int:
        # Every running request's adapter counts, scheduled this step or not: it needs a slot
        # in the next step it runs, alongside whatever is admitted now.
        loras = {r.lora_int_id for r in self.running if r.lora_int_id}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            new_adapter = request.lora_int_id and request.lora_int_id not in loras and len(loras) >= self.max_loras
            if new_adapter or _other_weights(request, step_adapters):
                skipped.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self._chunk(num_new, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                break
            self._new_block_ids.extend(b.block_id for b in new_blocks)
            self.waiting.popleft()
            self.kv_cache_manager.record_prefix_lookup(request, num_hit)
            self._enqueue(self.running, request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.lora_int_id:
                loras.add(request.lora_int_id)
                step_adapters[request.lora_int_id] = request.adapter_identity
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    lora_request=request.lora_request,
                    alora_invocation_start=request.alora_invocation_start,
                    lora_weights=request.lora_weights,
                )
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _chunk(self, num_needed: int, budget: int) -> int:
        """Tokens a request computes this step: what it needs, within the budget and the
        per-request cap."""
        cap = self.config.long_prefill_token_threshold
        return min(num_needed, budget, cap) if cap > 0 else min(num_needed, budget)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(self.waiting, request, front=True)

    def _enqueue(self, queue, request: Request, front: bool = False) -> None:
        """Into `queue` at its place: by `sort_key` under the priority policy; under FCFS,
        `running` by arrival time (so its end is the newest, the victim, even when a request
        skipped for `max_loras` is admitted after a newer one), `waiting` at the end (or, for a
        preempted request, the front: it resumes first)."""
        if self._by_priority:
            bisect.insort_right(queue, request, key=_sort_key)
        elif queue is self.running:
            bisect.insort_right(queue, request, key=_arrival)
        elif front:
            queue.appendleft(request)
        else:
            queue.append(request)

    def _fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Bitmask rows for constrained requests that sample at the end of this step."""
        rows = []
        for request_id in output.num_scheduled_tokens:
            request = self.requests[request_id]
            if request.grammar is not None and request.num_computed_tokens == request.num_tokens:
                rows.append((len(rows), request.grammar))
                output.grammar_rows[request_id] = len(rows) - 1
        if rows:
            bitmask = self.structured_output_manager.allocate_bitmask(len(rows))
            self.structured_output_manager.fill_bitmask(bitmask, rows)
            output.grammar_bitmask = bitmask

    # ---------------------------------------------------------------- update
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for req_id, sampled in zip(result.req_ids, result.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue  # finished meanwhile
            new_tokens: list[int] = []
            for token_id in sampled:
                request.append_output_token_id(token_id)
                new_tokens.append(token_id)
                if self._check_stop(request, token_id):
                    break
            self._count_tokens(request, len(new_tokens))
            prompt_logprobs = result.prompt_logprobs.get(req_id)
            if not new_tokens and not prompt_logprobs:
                continue
            logprobs = result.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_tokens,
                    finish_reason=RequestStatus.finish_reason(request.status),
                    stop_reason=request.stop_reason,
                    new_logprobs=logprobs[: len(new_tokens)] if logprobs else None,
                    new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return outputs

    def _count_tokens(self, request: Request, num_new: int) -> None:
        self.num_generation_tokens += num_new
        if num_new and request.num_output_tokens == num_new:  # its first tokens
            self.num_prompt_tokens += request.num_prompt_tokens

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        status: Optional[RequestStatus] = None
        if request.grammar is not None and not request.grammar.accept_token(token_id):
            # The mask allowed only grammar tokens, so a rejection means a broken state.
            status = RequestStatus.FINISHED_ABORTED
        elif request.num_output_tokens >= params.min_tokens and token_id in params.all_stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
        elif request.grammar is not None and request.grammar.is_terminated():
            status = RequestStatus.FINISHED_STOPPED
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        if status is None:
            return False
        request.status = status
        return True


def _sort_key(request: Request) -> tuple[int, float]:
    return request.sort_key


def _arrival(request: Request) -> float:
    return request.arrival_time


def _other_weights(request: Request, step_adapters: dict[int, object]) -> bool:
    """Whether the request's `lora_int_id` is already in the step with different weights."""
    if not request.lora_int_id or request.lora_int_id not in step_adapters:
        return False
    return step_adapters[request.lora_int_id] != request.adapter_identity
