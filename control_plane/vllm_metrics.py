"""One vLLM ``/metrics`` page as numbers, and the pure arithmetic over two of them.

:func:`parse_vllm_metrics` reads the Prometheus text vLLM serves and keeps what
the fleet view needs, summed over every label set (``model_name``, ``engine``;
data-parallel engines are one series each):

* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens;
  older releases: ``vllm:gpu_prefix_cache_queries_total`` / ``..._hits_total``);
* ``vllm:time_to_first_token_seconds_bucket`` (cumulative buckets by ``le``);
* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (summed);
* ``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``; averaged
  over engines, it is a fraction in [0, 1]);
* ``vllm:request_prefill_time_seconds_sum`` and ``vllm:cache_config_info``'s
  ``num_gpu_blocks x block_size``: what the router learns of an instance (its prefill
  rate, :func:`learned_rate`, and its KV cache size).

A metric the page lacks reads as ``None``; it is not an error. Text that is not
Prometheus exposition raises :class:`MetricsFormatError`.

Rates over a window are differences of counters between two readings
(:func:`reading_delta`): a counter that went down means the server restarted,
and the newer reading alone is the delta, as Prometheus' ``rate()`` assumes.
:func:`histogram_quantile` is Prometheus' estimate (linear interpolation inside
the bucket holding the rank; the highest finite bound when the rank falls in
``+Inf``). Everything here is pure and O(series) per page.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from prefix_router.core.work import learned_prefill_rate

__all__ = [
    "Buckets",
    "MetricsFormatError",
    "VllmDelta",
    "VllmReading",
    "bucket_delta",
    "histogram_quantile",
    "learned_rate",
    "merge_buckets",
    "parse_vllm_metrics",
    "ratio",
    "reading_delta",
    "sum_deltas",
]

Buckets = tuple[tuple[float, float], ...]
"""Cumulative histogram buckets ``(upper bound, count)``, sorted, ``+Inf`` last."""

QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
CACHE_CONFIG = "vllm:cache_config_info"


class MetricsFormatError(ValueError):
    """The page is not Prometheus text exposition."""


@dataclass(frozen=True, slots=True)
class VllmReading:
    """What one scrape of one instance said. ``None``: the page had no such metric."""

    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    ttft_buckets: Buckets = ()
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prefill_seconds: float | None = None
    """``vllm:request_prefill_time_seconds_sum``: seconds of prefill since start."""
    kv_cache_tokens: float | None = None
    """``num_gpu_blocks x block_size`` from ``vllm:cache_config_info``: the KV cache's size."""

    @property
    def hit_rate(self) -> float | None:
        """Cumulative prefix-cache hit rate (tokens hit / tokens queried) since start."""
        return ratio(self.prefix_cache_hits, self.prefix_cache_queries)


def learned_rate(new: VllmReading, old: VllmReading | None, elapsed_s: float) -> float | None:
    """The instance's prefill rate over the ``elapsed_s`` between two readings (see
    :func:`prefix_router.core.work.learned_prefill_rate`); None if it cannot tell."""
    if old is None:
        return None
    queries = _counter_delta(new.prefix_cache_queries, old.prefix_cache_queries)
    hits = _counter_delta(new.prefix_cache_hits, old.prefix_cache_hits)
    seconds = _counter_delta(new.prefill_seconds, old.prefill_seconds)
    if queries is None or hits is None or seconds is None:
        return None
    return learned_prefill_rate(queries - hits, seconds, elapsed_s)


@dataclass(frozen=True, slots=True)
class VllmDelta:
    """Counter increases between two readings."""

    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    ttft_buckets: Buckets = ()

    @property
    def hit_rate(self) -> float | None:
        return ratio(self.prefix_cache_hits, self.prefix_cache_queries)

    def ttft(self, q: float) -> float | None:
        return histogram_quantile(q, self.ttft_buckets)


def parse_vllm_metrics(text: str) -> VllmReading:
    """The numbers the fleet view needs from one vLLM ``/metrics`` page."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    buckets: dict[float, float] = defaultdict(float)
    kv_tokens = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == CACHE_CONFIG:
                    kv_tokens += _kv_tokens(sample.labels)
                elif sample.name == TTFT_BUCKET:
                    bound = _bound(sample.labels.get("le"))
                    if bound is not None:
                        buckets[bound] += sample.value
                elif not math.isnan(sample.value):
                    sums[sample.name] += sample.value
                    counts[sample.name] += 1
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from None

    def first(names: Iterable[str]) -> float | None:
        for name in names:
            if counts[name]:
                return sums[name]
        return None

    kv_name = next((n for n in KV_USAGE if counts[n]), None)
    return VllmReading(
        prefix_cache_queries=first(QUERIES),
        prefix_cache_hits=first(HITS),
        ttft_buckets=_complete(buckets),
        running=first((RUNNING,)),
        waiting=first((WAITING,)),
        kv_cache_usage=sums[kv_name] / counts[kv_name] if kv_name else None,
        prefill_seconds=first((PREFILL_SECONDS,)),
        kv_cache_tokens=kv_tokens or None,
    )


def _kv_tokens(labels: dict[str, str]) -> float:
    """One engine's KV cache size in tokens from its ``cache_config_info`` labels (0: unknown)."""
    try:
        return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
    except (KeyError, ValueError):
        return 0.0


def _bound(le: str | None) -> float | None:
    try:
        return float(le) if le is not None else None
    except ValueError:
        return None


def _complete(buckets: dict[float, float]) -> Buckets:
    """Sorted buckets, or none when the ``+Inf`` bucket (the total) is missing."""
    if math.inf not in buckets:
        return ()
    return tuple(sorted(buckets.items()))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; ``None`` when either is missing or nothing was counted."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return min(1.0, max(0.0, numerator / denominator))


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``buckets``; ``None`` if empty."""
    if not buckets or not 0.0 <= q <= 1.0 or buckets[-1][0] != math.inf:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0] if len(buckets) > 1 else None
    upper, count = buckets[index]
    lower, below = (0.0, 0.0) if index == 0 else buckets[index - 1]
    if index == 0 and upper <= 0:
        return upper
    inside = count - below
    if inside <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / inside


def bucket_delta(new: Buckets, old: Buckets) -> Buckets:
    """Observations between two readings; ``new`` itself after a reset or a bucket change."""
    if not old or [b for b, _ in new] != [b for b, _ in old]:
        return new
    if any(n < o for (_, n), (_, o) in zip(new, old, strict=True)):
        return new
    return tuple((b, n - o) for (b, n), (_, o) in zip(new, old, strict=True))


def merge_buckets(parts: Iterable[Buckets]) -> Buckets:
    """Sum of several instances' buckets; instances whose bounds differ from the first are
    left out (vLLM's bounds are fixed, so only a different server version differs)."""
    merged: list[tuple[float, float]] = []
    for part in parts:
        if not part:
            continue
        if not merged:
            merged = list(part)
        elif [b for b, _ in merged] == [b for b, _ in part]:
            merged = [(b, m + n) for (b, m), (_, n) in zip(merged, part, strict=True)]
    return tuple(merged)


def _counter_delta(new: float | None, old: float | None) -> float | None:
    if new is None:
        return None
    if old is None or new < old:
        return new
    return new - old


def reading_delta(new: VllmReading, old: VllmReading | None) -> VllmDelta:
    """What happened between ``old`` and ``new`` (``old`` ``None``: since the server started)."""
    if old is None:
        return VllmDelta(new.prefix_cache_queries, new.prefix_cache_hits, new.ttft_buckets)
    queries = _counter_delta(new.prefix_cache_queries, old.prefix_cache_queries)
    hits = _counter_delta(new.prefix_cache_hits, old.prefix_cache_hits)
    if (
        new.prefix_cache_queries is not None
        and old.prefix_cache_queries is not None
        and new.prefix_cache_queries < old.prefix_cache_queries
    ):
        hits = new.prefix_cache_hits  # the server restarted: both counters start over
    return VllmDelta(queries, hits, bucket_delta(new.ttft_buckets, old.ttft_buckets))


def sum_deltas(deltas: Iterable[VllmDelta]) -> VllmDelta:
    """Fleet-wide: counters summed over instances, histograms merged."""
    deltas = list(deltas)

    def total(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) if present else None

    return VllmDelta(
        prefix_cache_queries=total([d.prefix_cache_queries for d in deltas]),
        prefix_cache_hits=total([d.prefix_cache_hits for d in deltas]),
        ttft_buckets=merge_buckets(d.ttft_buckets for d in deltas),
    )
