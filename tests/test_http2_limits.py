"""The HTTP/2 limits' settings, flags, token bucket and breach reporting: pure, fast."""

from __future__ import annotations

import argparse
import logging

import pytest

from ext_proc.http2.limits import (
    DEFAULT_MAX_BODY_BYTES,
    MESSAGE_OVERHEAD_BYTES,
    BreachReporter,
    PeerLimits,
    TokenBucket,
    add_flags,
    default_max_connections,
    limits_from_args,
)
from prefix_router.envoy.bootstrap import EXT_PROC_MAX_CONCURRENT_STREAMS, BootstrapParams


def test_the_default_body_limit_is_the_bootstraps() -> None:
    params = BootstrapParams(listen_port=1, admin_port=2, ext_proc=())
    assert params.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert PeerLimits().max_message_bytes >= params.max_body_bytes


def test_envoy_is_told_ext_procs_default_stream_limit() -> None:
    assert EXT_PROC_MAX_CONCURRENT_STREAMS == PeerLimits().max_concurrent_streams


def test_message_size_and_budgets_follow_the_body_limit() -> None:
    limits = PeerLimits.for_body_limit(1 << 20)
    message = (1 << 20) + MESSAGE_OVERHEAD_BYTES
    assert limits.max_message_bytes == message
    assert limits.connection_partial_bytes == 2 * message
    assert limits.process_partial_bytes == 4 * message
    assert PeerLimits.for_body_limit(1 << 20, max_concurrent_streams=7).max_concurrent_streams == 7


def test_the_connection_cap_follows_the_open_file_limit() -> None:
    assert PeerLimits().max_connections == default_max_connections() >= 16
    assert PeerLimits(max_connections=5).max_connections == 5


@pytest.mark.parametrize(
    "bad",
    [
        {"max_concurrent_streams": 0},
        {"reset_rate": -1.0},
        {"max_frame_size": 1000},
        {"max_frame_size": 1 << 24},
        {"connection_partial_bytes": 10, "process_partial_bytes": 5},
    ],
)
def test_limits_that_make_no_sense_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PeerLimits(**bad)  # type: ignore[arg-type]


def test_every_limit_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(
        ["--max-body-bytes", "2048", "--h2-max-concurrent-streams", "9", "--h2-reset-rate", "2.5"]
    )
    limits = limits_from_args(args)
    assert limits.max_concurrent_streams == 9
    assert limits.reset_rate == 2.5
    assert limits.max_message_bytes == 2048 + MESSAGE_OVERHEAD_BYTES
    assert limits.idle_timeout == PeerLimits().idle_timeout
    help_text = parser.format_help()
    for name in PeerLimits.__dataclass_fields__:
        assert f"--h2-{name.replace('_', '-')}" in help_text


def test_a_token_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(burst=3, rate=2.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.5)  # one token back after half a second
    assert not bucket.take(0.5)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # capped


def test_breaches_are_all_counted_and_logged_once_a_minute_per_peer_and_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    counted: list[str] = []
    reporter = BreachReporter(counted.append, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="prefix_router.ext_proc.http2"):
        for _ in range(5):
            reporter.breach("reset_burst", "10.0.0.1")
        reporter.breach("reset_burst", "10.0.0.2")
        reporter.breach("max_continuations", "10.0.0.1")
        reporter.breach("idle_timeout", "10.0.0.1", quiet=True)
        now[0] = 61.0
        reporter.breach("reset_burst", "10.0.0.1")
    assert counted.count("reset_burst") == 7
    assert reporter.totals == {"reset_burst": 7, "max_continuations": 1, "idle_timeout": 1}
    logged = [(r.args[0], r.args[1]) for r in caplog.records]  # type: ignore[index]
    assert logged == [
        ("10.0.0.1", "reset_burst"),
        ("10.0.0.2", "reset_burst"),
        ("10.0.0.1", "max_continuations"),
        ("10.0.0.1", "reset_burst"),
    ]
