"""`ServerMetrics`: the Prometheus metrics behind GET /metrics, with vLLM's names.

What it owns: a private registry with
- per-request series observed from the engine thread's outputs (`AsyncLLM`'s
  `OutputObserver`): `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
  `vllm:request_success_total{finished_reason}`, and the histograms
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds`;
- engine-state series read from `AsyncLLM.get_stats()` at scrape time:
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (a fraction, 1.0 = full, as in vLLM), `vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total` (tokens), `vllm:num_preemptions_total`, and ours,
  `vllm:alora_reused_prompt_tokens_total`: prompt tokens of aLoRA requests served from
  KV blocks the base model computed; `vllm:kv_cache_free_blocks` and
  `vllm:kv_cache_total_blocks`: blocks no request references (cached prefix blocks
  nobody holds count as free: they are evicted on demand) and all blocks, so an idle
  server with free < total has leaked references;
- the server process's own series (`process_resident_memory_bytes`,
  `process_open_fds`, ...) from prometheus_client's process collector, so a soak run can
  watch the server's memory through /metrics alone (empty where /proc is missing).

Invariants: `record` and `record_abort` run only on the engine thread and only see DELTA
outputs (what `AsyncLLM` produces), so each generated token is counted once; an aborted
request counts as `finished_reason="abort"` and leaves no per-request state behind.
Every `vllm:` series carries the `model_name` label.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm.engine.core import EngineStats
from vllm.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_FINISH_REASONS = ("stop", "length", "abort")


class _EngineStatsCollector:
    """Reads the engine's latest stats snapshot when Prometheus scrapes."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        label = [self.model_name]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests running in the engine.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
            ("vllm:kv_cache_free_blocks", "KV-cache blocks no request holds (unreferenced cached blocks included).",
             s.num_free_blocks),
            ("vllm:kv_cache_total_blocks", "KV-cache blocks in all.", s.num_blocks),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("vllm:alora_reused_prompt_tokens", "Prompt tokens of aLoRA requests served from base-model KV blocks.",
             s.alora_reused_tokens),
            ("vllm:num_preemptions", "Requests preempted to free KV-cache blocks.", s.num_preemptions),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter
        if s.max_lora:
            # vLLM's shape: the labels carry the adapters; the value is when they were read.
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(s.max_lora), ",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters)],
                            time.time())
            yield info


class ServerMetrics:
    def __init__(self, model_name: str):
        # Like vLLM: no `*_created` series (a process-wide prometheus_client setting).
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        # The private registry does not get the default process series; add them (vLLM's
        # /metrics shows them too, from prometheus_client's global registry).
        ProcessCollector(registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced.", labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens in seconds.",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", labels,
                             buckets=_E2E_BUCKETS, registry=r)
        # Create the labelled children now so every series is scraped (as 0) from the start.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)
        for reason in _FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self._last_token_time: dict[str, float] = {}  # request id -> time of its latest token

    def attach(self, stats: Callable[[], EngineStats]) -> None:
        """Read engine state from `stats` (e.g. `AsyncLLM.get_stats`) at scrape time."""
        self.registry.register(_EngineStatsCollector(self.model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------ OutputObserver
    def record(self, outputs: list[RequestOutput]) -> None:
        m = self.model_name
        for output in outputs:
            metrics = output.metrics
            new_tokens = sum(len(c.token_ids) for c in output.outputs)
            if new_tokens and metrics is not None and metrics.last_token_time is not None:
                self.generation_tokens.labels(m).inc(new_tokens)
                previous = self._last_token_time.get(output.request_id)
                if previous is None:
                    self.prompt_tokens.labels(m).inc(len(output.prompt_token_ids))
                    if metrics.time_to_first_token is not None:
                        self.ttft.labels(m).observe(metrics.time_to_first_token)
                else:
                    self.itl.labels(m).observe(metrics.last_token_time - previous)
                self._last_token_time[output.request_id] = metrics.last_token_time
            if output.finished:
                self._last_token_time.pop(output.request_id, None)
                if metrics is not None and metrics.finished_time is not None:
                    self.e2e.labels(m).observe(metrics.finished_time - metrics.arrival_time)
                self.request_success.labels(m, self._finish_reason(output)).inc()

    def record_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    @staticmethod
    def _finish_reason(output: RequestOutput) -> str:
        reasons: list[Optional[str]] = [c.finish_reason for c in output.outputs]
        return next((r for r in reasons if r), "stop")
