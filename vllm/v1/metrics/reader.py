"""What `LLM.get_metrics()` returns: vLLM's metric objects (`Counter`, `Gauge`,
`Histogram`, `Vector`, all `Metric`s with `name` and `labels`), so scripts written for
`from vllm.v1.metrics.reader import Counter, Gauge` work unchanged.

`metrics_from_stats` builds them from one `EngineStats` snapshot, with the names the
server's GET /metrics exports (counters without `_total`, as vLLM's reader names them):
gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
(a fraction, 1.0 = full); counters `vllm:prompt_tokens`, `vllm:generation_tokens`,
`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` (tokens), `vllm:num_preemptions` and
ours, `vllm:alora_reused_prompt_tokens`. Every metric carries the labels `model_name` and
`engine` ("0": one engine per process). Offline there are no latency histograms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.engine.core import EngineStats


@dataclass
class Metric:
    """One series: a name and its labels (several series may share a name)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: upper limit (with a '+Inf' key) -> count; `count` and `sum`
    over all observations."""

    count: int
    sum: float
    buckets: dict[str, int]


_GAUGES = (
    ("vllm:num_requests_running", "num_running"),
    ("vllm:num_requests_waiting", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage"),
)
_COUNTERS = (
    ("vllm:prompt_tokens", "prompt_tokens"),
    ("vllm:generation_tokens", "generation_tokens"),
    ("vllm:prefix_cache_queries", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "prefix_cache_hits"),
    ("vllm:num_preemptions", "num_preemptions"),
    ("vllm:alora_reused_prompt_tokens", "alora_reused_tokens"),
)


def metrics_from_stats(stats: "EngineStats", model_name: str) -> list[Metric]:
    labels = {"model_name": model_name, "engine": "0"}
    gauges: list[Metric] = [Gauge(name, dict(labels), float(getattr(stats, field))) for name, field in _GAUGES]
    counters = [Counter(name, dict(labels), int(getattr(stats, field))) for name, field in _COUNTERS]
    return gauges + counters
