"""The benchmark scripts' shared helpers that need no stack (one reads the test Redis)."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.scripts._harness import ROOT, checkout_env, median_rounds, run_heading
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


def test_a_baseline_checkout_runs_its_own_code_even_started_from_this_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m prefix_router`` started from the repository's root imports the root's
    code whatever PYTHONPATH says, unless the environment keeps the working directory off
    ``sys.path``: a comparison with a baseline then measured this checkout twice."""
    for package in ("ext_proc", "prefix_router"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "prefix_router" / "__main__.py").write_text("print(__file__)\n")
    monkeypatch.chdir(ROOT)
    env = checkout_env(tmp_path)
    main = subprocess.check_output(
        [sys.executable, "-m", "prefix_router"], env={**os.environ, **env}, text=True, timeout=60
    )
    assert Path(main.strip()) == tmp_path.resolve() / "prefix_router" / "__main__.py"


def test_a_directory_that_is_not_a_checkout_is_refused_as_a_baseline(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="would import ext_proc from"):
        checkout_env(tmp_path)
