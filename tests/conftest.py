"""Shared fixtures: free ports, a log folder per test, and a process reaper.

Every process a test starts goes through ``procs`` and is stopped at teardown,
also when the test fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefix_router.ops.launch import delete_namespace
from prefix_router.ops.procs import ManagedProcess

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

pytest_plugins = ["tests.support.state_records"]  # the ``store`` fixture of the state tests


class ProcessReaper:
    def __init__(self) -> None:
        self.started: list[ManagedProcess] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop(grace=3.0)


@pytest.fixture
def procs() -> Iterator[ProcessReaper]:
    reaper = ProcessReaper()
    try:
        yield reaper
    finally:
        reaper.stop_all()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


@pytest.fixture
def namespace() -> Iterator[str]:
    """A Redis key prefix of this test's own; every key under it is deleted afterwards.

    Request it before ``procs``: fixtures tear down in reverse, so the keys are deleted
    after every process the test started has stopped.
    """
    ns = f"test-{uuid.uuid4().hex[:12]}:"
    yield ns
    delete_namespace(REDIS_URL, ns)
