"""Prometheus exposition of one engine, with vLLM's metric names and labels.

A custom collector reads the engine's plain counters (:mod:`vllm_sim.stats`) and live
scheduler state only when ``/metrics`` is scraped, so serving requests costs no
prometheus_client calls. Labels: ``model_name`` (the base model) and ``engine`` (index).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from vllm_sim.engine import Engine
from vllm_sim.stats import Histogram

__all__ = ["CONTENT_TYPE_LATEST", "EngineCollector", "render_metrics"]

_LABELS = ("model_name", "engine")


def _bound(value: float) -> str:
    return "+Inf" if math.isinf(value) else repr(float(value))


class EngineCollector:
    """``collect()`` yields vLLM's metric families for one engine."""

    def __init__(self, engine: Engine, *, engine_index: int = 0) -> None:
        self._engine = engine
        self._labels = [engine.config.model, str(engine_index)]

    def collect(self) -> Iterable[Metric]:
        engine, labels = self._engine, self._labels
        stats, scheduler, config = engine.stats, engine.scheduler, engine.config

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        def histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
            family = HistogramMetricFamily(name, doc, labels=_LABELS)
            buckets = [(_bound(b), float(n)) for b, n in hist.cumulative()]
            family.add_metric(labels, buckets, hist.total)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(scheduler.running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(scheduler.waiting),
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (pinned blocks only).",
            scheduler.cache.usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", stats.preemptions
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of finished requests.",
            labels=(*_LABELS, "finished_reason"),
        )
        for reason in sorted({"stop", "length", "abort", *stats.finished}):
            success.add_metric([*labels, reason], stats.finished.get(reason, 0))
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stats.ttft,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            stats.e2e,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            stats.itl,
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            stats.queue_time,
        )
        yield histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            stats.prefill_time,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=("block_size", "num_gpu_blocks", "enable_prefix_caching", *_LABELS),
        )
        info.add_metric(
            [
                str(config.block_size),
                str(config.num_gpu_blocks),
                str(config.enable_prefix_caching),
                *labels,
            ],
            1.0,
        )
        yield info


def render_metrics(collector: EngineCollector) -> bytes:
    """Prometheus text exposition (format 0.0.4) of one collector."""
    return generate_latest(collector)
