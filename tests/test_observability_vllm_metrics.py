"""Pure fleet-view arithmetic: parsing vLLM metrics, quantiles, deltas, windows (table-driven)."""

from __future__ import annotations

import math

import pytest

from control_plane.fleet_view import Scrape, Window, fleet_stats, instance_stats
from control_plane.loads_view import LoadsReading
from control_plane.vllm_metrics import (
    MetricsFormatError,
    VllmReading,
    bucket_delta,
    histogram_quantile,
    learned_rate,
    merge_buckets,
    parse_vllm_metrics,
    reading_delta,
    sum_deltas,
)
from prefix_router.core.fleet import Instance

INF = math.inf

# What a vLLM v1 server with two data-parallel engines serves (labels as vLLM sets them,
# counters with _created, the full TTFT bucket list truncated to a few bounds).
TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 1.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="llama"} 3000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="llama"} 1.7e9
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="llama"} 2400.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="llama"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="llama"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama"} 2.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="llama"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="llama"} 1.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="81000"} 1.0
"""

# An older vLLM: gpu_-prefixed names, no TTFT histogram, no engine label.
OLD_NAMES = """\
vllm:gpu_prefix_cache_queries_total{model_name="m"} 200
vllm:gpu_prefix_cache_hits_total{model_name="m"} 50
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
vllm:num_requests_running{model_name="m"} 1
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            TWO_ENGINES,
            VllmReading(
                prefix_cache_queries=4000.0,
                prefix_cache_hits=3000.0,
                ttft_buckets=((0.1, 10.0), (0.5, 18.0), (INF, 20.0)),
                running=5.0,
                waiting=1.0,
                kv_cache_usage=0.375,
                kv_cache_tokens=81000 * 16.0,  # num_gpu_blocks x block_size
            ),
        ),
        (
            OLD_NAMES,
            VllmReading(
                prefix_cache_queries=200.0,
                prefix_cache_hits=50.0,
                running=1.0,
                kv_cache_usage=0.75,
            ),
        ),
        ("", VllmReading()),
        ("# only comments\n", VllmReading()),
        ("some_other_exporter_metric 1\n", VllmReading()),
        # buckets without +Inf cannot be read as a histogram
        ('vllm:time_to_first_token_seconds_bucket{le="0.1"} 3\n', VllmReading()),
        # current names win over the deprecated ones when a server serves both
        (
            "vllm:prefix_cache_queries_total 10\nvllm:gpu_prefix_cache_queries_total 99\n"
            "vllm:prefix_cache_hits_total 4\nvllm:gpu_prefix_cache_hits_total 98\n",
            VllmReading(prefix_cache_queries=10.0, prefix_cache_hits=4.0),
        ),
    ],
    ids=["two-engines", "old-names", "empty", "comments", "other-exporter", "no-inf", "both"],
)
def test_parse_vllm_metrics(text: str, expected: VllmReading) -> None:
    assert parse_vllm_metrics(text) == expected


@pytest.mark.parametrize(
    ("old", "new", "elapsed_s", "expected"),
    [
        # 9,000 prompt tokens queried, 3,000 hit: 6,000 computed in 2 s of prefill over
        # 16 s: 0.125 requests in prefill on average, so almost alone: 3,000 x sqrt(1.125)
        (
            VllmReading(1000.0, 400.0, prefill_seconds=1.0),
            VllmReading(10000.0, 3400.0, prefill_seconds=3.0),
            16.0,
            3000.0 * 1.125**0.5,
        ),
        # 90,000 computed with 30 s of per-request prefill time over 10 s: three requests
        # at a time in prefill. Between 3,000 tokens/s (each alone for 30 s) and 12,000
        # (all sharing steps, busy 3/4 of the time): the geometric mean
        (
            VllmReading(0.0, 0.0, prefill_seconds=0.0),
            VllmReading(90000.0, 0.0, prefill_seconds=30.0),
            10.0,
            6000.0,
        ),
        # too little prefill in the window to tell
        (
            VllmReading(1000.0, 400.0, prefill_seconds=1.0),
            VllmReading(2000.0, 400.0, prefill_seconds=1.5),
            60.0,
            None,
        ),
        # a server without the prefill histogram
        (VllmReading(1000.0, 400.0), VllmReading(9000.0, 400.0), 60.0, None),
        # a restart (counters went down): the newer reading alone is the window
        (
            VllmReading(90000.0, 400.0, prefill_seconds=90.0),
            VllmReading(6000.0, 0.0, prefill_seconds=2.0),
            8.0,
            3000.0 * 1.25**0.5,
        ),
    ],
)
def test_the_prefill_rate_is_learned_from_computed_tokens_per_second_of_prefill(
    old: VllmReading, new: VllmReading, elapsed_s: float, expected: float | None
) -> None:
    assert learned_rate(new, old, elapsed_s) == pytest.approx(expected)
    assert learned_rate(new, None, elapsed_s) is None


@pytest.mark.parametrize("text", ['{"backend": "8001", "bytes": 0}', "<html>nope</html>\n"])
def test_text_that_is_not_prometheus_is_an_error(text: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_vllm_metrics(text)


def test_parse_the_simulator_page() -> None:
    from vllm_sim import SimInstance, make_config

    instance = SimInstance(make_config(), name="sim")
    reading = parse_vllm_metrics(instance.metrics_text().decode())
    assert reading.prefix_cache_queries == 0 and reading.prefix_cache_hits == 0
    assert reading.running == 0 and reading.waiting == 0 and reading.kv_cache_usage == 0
    assert reading.ttft_buckets[-1] == (INF, 0.0) and len(reading.ttft_buckets) == 23


B = ((0.1, 10.0), (0.5, 18.0), (1.0, 19.0), (INF, 20.0))


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, B, 0.1),  # rank 10 = exactly the first bucket's count
        (0.25, B, 0.05),  # rank 5 inside the first bucket: 0 + 0.1 * 5/10
        (0.7, B, 0.1 + 0.4 * 4 / 8),  # rank 14 inside (0.1, 0.5]
        (0.95, B, 1.0),  # rank 19 = the (0.5, 1.0] bucket's top
        (0.99, B, 1.0),  # rank 19.8 falls in +Inf: the highest finite bound
        (1.0, B, 1.0),
        (0.5, ((0.1, 0.0), (INF, 0.0)), None),  # nothing observed
        (0.5, (), None),
        (0.5, ((0.1, 1.0), (0.5, 2.0)), None),  # no +Inf bucket
        (1.5, B, None),
        (0.5, ((INF, 4.0),), None),  # only +Inf: no finite bound to report
        (0.5, ((0.2, 0.0), (0.4, 4.0), (INF, 4.0)), 0.3),
    ],
)
def test_histogram_quantile(
    q: float, buckets: tuple[tuple[float, float], ...], expected: float | None
) -> None:
    got = histogram_quantile(q, buckets)
    assert got == pytest.approx(expected) if expected is not None else got is None


@pytest.mark.parametrize(
    ("new", "old", "expected"),
    [
        (((1.0, 5.0), (INF, 7.0)), ((1.0, 2.0), (INF, 3.0)), ((1.0, 3.0), (INF, 4.0))),
        (((1.0, 5.0), (INF, 7.0)), (), ((1.0, 5.0), (INF, 7.0))),
        # a reset (restart): the new buckets alone
        (((1.0, 1.0), (INF, 1.0)), ((1.0, 2.0), (INF, 3.0)), ((1.0, 1.0), (INF, 1.0))),
        # other bounds (another server version): the new buckets alone
        (((2.0, 5.0), (INF, 7.0)), ((1.0, 2.0), (INF, 3.0)), ((2.0, 5.0), (INF, 7.0))),
    ],
    ids=["grows", "no-old", "reset", "other-bounds"],
)
def test_bucket_delta(
    new: tuple[tuple[float, float], ...],
    old: tuple[tuple[float, float], ...],
    expected: tuple[tuple[float, float], ...],
) -> None:
    assert bucket_delta(new, old) == expected


@pytest.mark.parametrize(
    ("new", "old", "queries", "hits", "hit_rate"),
    [
        (VllmReading(100, 80), VllmReading(60, 50), 40, 30, 0.75),
        (VllmReading(100, 80), None, 100, 80, 0.8),
        (VllmReading(30, 10), VllmReading(100, 80), 30, 10, 1 / 3),  # restarted
        (VllmReading(100, 80), VllmReading(100, 80), 0, 0, None),  # idle: unknown, not 0
        (VllmReading(None, None), VllmReading(100, 80), None, None, None),
    ],
    ids=["grows", "since-start", "restart", "idle", "metric-gone"],
)
def test_reading_delta(
    new: VllmReading,
    old: VllmReading | None,
    queries: float | None,
    hits: float | None,
    hit_rate: float | None,
) -> None:
    delta = reading_delta(new, old)
    assert (delta.prefix_cache_queries, delta.prefix_cache_hits) == (queries, hits)
    assert delta.hit_rate == (pytest.approx(hit_rate) if hit_rate is not None else None)


def test_fleet_sums_tokens_not_rates_and_merges_histograms() -> None:
    a = reading_delta(VllmReading(1000, 900, ((1.0, 2.0), (INF, 2.0))), None)
    b = reading_delta(VllmReading(10, 0, ((1.0, 0.0), (INF, 2.0))), None)
    odd = reading_delta(VllmReading(None, None, ((5.0, 1.0), (INF, 1.0))), None)
    total = sum_deltas([a, b, odd])
    assert total.hit_rate == pytest.approx(900 / 1010)  # not the mean of 0.9 and 0.0
    assert total.ttft_buckets == ((1.0, 2.0), (INF, 4.0))  # other bounds are left out
    assert merge_buckets([(), ((1.0, 1.0), (INF, 1.0))]) == ((1.0, 1.0), (INF, 1.0))
    assert sum_deltas([]).hit_rate is None


def test_window_covers_the_span_from_a_baseline() -> None:
    w: Window[int] = Window(10.0)
    assert (w.oldest, w.newest) == (None, None)
    w.add(0.0, 1)
    assert (w.oldest, w.newest) == (None, 1)  # one value is not a window yet
    for t in (2.0, 4.0, 11.0, 13.0):
        w.add(t, int(t))
    assert (w.oldest, w.newest) == (2, 13)  # 2 is the newest at least 10 s old: the baseline
    w.add(100.0, 100)
    assert (w.oldest, w.newest) == (13, 100)  # a gap: the last value before it stays


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ([(0, 0), (8, 2)], 0.8),
        ([(10, 0), (10, 0)], None),  # no decision in the window
        ([(50, 50), (3, 1)], 0.75),  # counts went back (namespace reset): the new ones
        ([(5, 5)], None),
    ],
)
def test_predicted_affinity_over_the_window(
    history: list[tuple[int, int]], expected: float | None
) -> None:
    decisions: Window[tuple[int, int]] = Window(60.0)
    for t, value in enumerate(history):
        decisions.add(float(t), value)
    home, spilled = history[-1]
    loads = LoadsReading(decisions={"home": home, "spilled": spilled})
    stats = fleet_stats([], [], loads, decisions)
    assert stats.predicted_affinity == (pytest.approx(expected) if expected is not None else None)
    assert stats.predicted_affinity_cumulative == (
        home / (home + spilled) if home + spilled else None
    )


def test_an_instance_no_longer_read_reports_no_last_minute() -> None:
    """A window an instance that stopped answering left behind is not its last minute any
    more: its hit rate and TTFT are unknown (left out), and the fleet's last minute is the
    instances still read; the cumulative figures keep everything ever read."""
    instance = Instance("10.0.0.1", 8000)
    live_reading = VllmReading(1000, 900, ((1.0, 2.0), (INF, 2.0)))
    dead: Window[VllmReading] = Window(60.0)
    dead.add(0.0, VllmReading(0, 0, ((1.0, 0.0), (INF, 0.0))))
    dead.add(2.0, live_reading)
    failed = Scrape(at=3600.0, reading=None, error="connection refused")
    row = instance_stats(
        instance,
        removing=False,
        ring_share=1.0,
        in_flight=0,
        scrape=failed,
        window=dead,
        now=3600.0,
    )
    assert (row.up, row.hit_rate, row.ttft_p50_s, row.ttft_p99_s) == (False, None, None, None)
    assert row.hit_rate_cumulative == pytest.approx(0.9)
    same_row = instance_stats(
        instance, removing=False, ring_share=1, in_flight=0, scrape=failed, window=dead, now=30
    )
    assert same_row.hit_rate == pytest.approx(0.9)  # still within the minute: still its own
    fleet = fleet_stats([dead], [row], LoadsReading(), Window(60.0), now=3600.0)
    assert fleet.hit_rate is None and fleet.hit_rate_cumulative == pytest.approx(0.9)
