"""The benchmark scripts' shared helpers that need no stack (one reads the test Redis)."""

from __future__ import annotations

import datetime
import re

import psutil

from bench.scripts._harness import median_rounds, run_heading
from bench.scripts.data_plane_latency import local_redis_pid
from prefix_router.ops.procs import free_port
from tests.conftest import REDIS_URL


def test_a_run_heading_names_when_and_which_commit() -> None:
    when = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.UTC)
    heading = run_heading(when)
    assert re.fullmatch(r"### Run of 2026-01-02 03:04 UTC at [0-9a-f]{7,40}\+?", heading), heading


def test_the_latency_benchmark_finds_a_local_redis_process_and_nothing_elsewhere() -> None:
    pid = local_redis_pid(REDIS_URL)
    assert pid is not None and psutil.Process(pid).name().startswith("redis-server")
    assert local_redis_pid(f"redis://127.0.0.1:{free_port()}/0") is None  # nothing listens


def test_rounds_keep_each_paths_median_and_every_error() -> None:
    rounds = [
        {
            "bare": {"p50": 1.0, "p99": 9.0, "errors": 0.0},
            "ours": {"p50": 0.5, "p99": 2.0, "errors": 1.0},
        },
        {
            "bare": {"p50": 3.0, "p99": 4.0, "errors": 2.0},
            "ours": {"p50": 0.9, "p99": 1.0, "errors": 0.0},
        },
        {
            "bare": {"p50": 2.0, "p99": 5.0, "errors": 0.0},
            "ours": {"p50": 0.1, "p99": 3.0, "errors": 0.0},
        },
    ]
    assert median_rounds(rounds) == {
        "bare": {"p50": 2.0, "p99": 5.0, "errors": 2.0},
        "ours": {"p50": 0.5, "p99": 2.0, "errors": 1.0},
    }
