"""A redis-server of a test's own, which the test may stop and start again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis

from prefix_router.ops.launch import start_redis_server
from prefix_router.ops.procs import ManagedProcess, free_port
from tests.conftest import ProcessReaper


class OwnRedis:
    """A redis-server on a free port that the test may stop and start again."""

    def __init__(self, procs: ProcessReaper, log_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH (.ci/run installs it)")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.procs = procs
        self.log_dir = log_dir
        self.proc: ManagedProcess | None = None

    def start(self) -> None:
        self.proc = self.procs.add(start_redis_server(self.binary, self.port, self.log_dir))

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def in_flight(self) -> dict[bytes, bytes]:
        client = redis.Redis.from_url(self.url)
        try:
            return client.hgetall("prefix-router:inflight")  # type: ignore[return-value]
        finally:
            client.close()
