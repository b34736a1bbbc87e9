"""The whole router as ``prefix-router up`` runs it (simulated vLLM, control plane, ext_proc,
Envoy), on free ports, on a unique Redis namespace, every process owned by the ``procs`` reaper.

``running_stack(procs, tmp_path)`` is a context manager; on exit the stack is stopped and
its namespace deleted (the reaper stops anything left, also when the test fails).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from prefix_router.core.config import RouterConfig
from prefix_router.ops.launch import start_module
from prefix_router.ops.procs import ManagedProcess, free_port
from prefix_router.ops.up import Stack, UpSettings
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.redis_ns import unique_namespace


@dataclass
class RunningStack:
    stack: Stack
    procs: ProcessReaper

    @property
    def settings(self) -> UpSettings:
        return self.stack.settings

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.admin_port}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.envoy_admin_port}"

    @property
    def log_dir(self) -> Path:
        return self.stack.log_dir

    @property
    def instance_ids(self) -> list[str]:
        assert self.stack.fleet is not None
        return [i.id for i in self.stack.fleet.instances]

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in self.stack.procs if p.name == name)

    def admin(self, *, token: str | None = None) -> httpx.Client:
        token = self.stack.token if token is None else token
        return httpx.Client(
            base_url=self.admin_url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        )

    def chat(
        self,
        client: httpx.Client,
        content: str,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> httpx.Response:
        body = {
            "model": "meta-llama/Llama-3.1-70B-Instruct",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            **extra,
        }
        return client.post(
            f"{self.url}/v1/chat/completions", content=json.dumps(body), headers=headers
        )

    def start_spare_sim(self, *, time_scale: float = 50.0) -> str:
        """One more simulated instance, outside the fleet; returns its id."""
        port = free_port()
        args = ["--ports", str(port), "--host", "127.0.0.1", "--time-scale", str(time_scale)]
        self.procs.add(
            start_module("spare-sim", "vllm_sim", args, self.log_dir, ready_ports=[port])
        )
        return f"127.0.0.1:{port}"


@contextlib.contextmanager
def running_stack(
    procs: ProcessReaper,
    tmp_path: Path,
    *,
    instances: int = 3,
    ext_procs: int = 1,
    sim_time_scale: float = 50.0,
    config: RouterConfig | None = None,
    sim_serve: list[str] | None = None,
) -> Iterator[RunningStack]:
    settings = UpSettings(
        sim_serve=sim_serve or [],
        port=free_port(),
        admin_port=free_port(),
        envoy_admin_port=free_port(),
        xds_port=free_port(),
        instances=instances,
        ext_procs=ext_procs,
        envoy_concurrency=1,
        sim_time_scale=sim_time_scale,
        redis_url=REDIS_URL,
        namespace=unique_namespace(),
        admin_token="test-admin-token",
        run_dir=str(tmp_path / "run"),
    )
    stack = Stack(settings, config or RouterConfig())
    try:
        try:
            stack.start()
        finally:
            for proc in stack.procs:  # the reaper stops them, also after a failed start
                procs.add(proc)
        yield RunningStack(stack, procs)
    finally:
        stack.stop()  # before the namespace goes: ext_proc writes its counts back on exit
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            keys = list(client.scan_iter(match=f"{settings.namespace}*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
