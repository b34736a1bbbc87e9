"""Serving many simulated instances from one process: one uvicorn server per port, one loop.

:func:`start_instances` binds every socket first (all or nothing, so a taken port fails fast
and leaves nothing behind), then runs one uvicorn ``Server`` per instance in the current
event loop and returns once all accept connections. Port 0 asks the OS for a free port; the
instance is named after the port it got. :func:`serve_instances` adds the process shell:
ready lines on stdout and graceful shutdown on SIGINT/SIGTERM.

Shutdown order: instances first (queued and streaming requests are aborted, hung ones are
released with 503), then the servers, so nothing waits for a request that cannot finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import socket
import sys
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from vllm_sim.app import create_app
from vllm_sim.config import DEFAULT_PROFILE, EngineConfig, make_config
from vllm_sim.errors import SimStartupError
from vllm_sim.instance import SimInstance

_START_TIMEOUT_S = 10.0
_GRACEFUL_SHUTDOWN_S = 3


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to :func:`serve_instances`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass(frozen=True, slots=True)
class RunningInstance:
    """An instance listening on ``host:port``."""

    instance: SimInstance
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(slots=True)
class SimCluster:
    """Instances started by :func:`start_instances`; :meth:`stop` ends them all."""

    members: list[RunningInstance]
    _servers: list[_Server] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    async def stop(self) -> None:
        for member in self.members:
            await member.instance.stop()
        for server in self._servers:
            server.should_exit = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _bind(host: str, ports: Sequence[int]) -> list[socket.socket]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise SimStartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sockets


def serving(config: EngineConfig, served: Sequence[str]) -> EngineConfig:
    """``config`` serving ``served``: the base model, then its LoRA adapters."""
    return dataclasses.replace(config, model=served[0], lora_modules=tuple(served[1:]))


async def start_instances(
    *,
    config: EngineConfig,
    host: str = "127.0.0.1",
    ports: Sequence[int],
    serve: Sequence[Sequence[str]] = (),
    api_key: str | None = None,
) -> SimCluster:
    """Start one instance per port in the running loop; returns when all accept requests.

    ``serve``: what each instance serves (base model, then adapters), cycled over the
    instances in port order; empty: every instance serves ``config``'s. ``api_key``: the
    ``/v1`` routes want it as a bearer token, as vLLM's ``--api-key`` does."""
    sockets = _bind(host, ports)
    cluster = SimCluster(members=[])
    for index, sock in enumerate(sockets):
        port = sock.getsockname()[1]
        own = serving(config, serve[index % len(serve)]) if serve else config
        instance = SimInstance(own, name=str(port), engine_index=0)
        uv_config = uvicorn.Config(
            create_app(instance, api_key=api_key),
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=30,
        )
        server = _Server(uv_config)
        cluster.members.append(RunningInstance(instance=instance, host=host, port=port))
        cluster._servers.append(server)
        task = asyncio.get_running_loop().create_task(
            server.serve(sockets=[sock]), name=f"vllm-sim-server-{index}"
        )
        cluster._tasks.append(task)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _START_TIMEOUT_S
    while not all(s.started for s in cluster._servers):
        failed = [t for t in cluster._tasks if t.done()]
        if failed or loop.time() > deadline:
            await cluster.stop()
            for sock in sockets:
                sock.close()
            raise SimStartupError("an instance's server did not start")
        await asyncio.sleep(0.01)
    return cluster


def ready_line(member: RunningInstance) -> str:
    config = member.instance.config
    return (
        f"vllm-sim instance {member.instance.name} ready on {member.url} "
        f"(model {config.model}, time_scale {config.time_scale:g})"
    )


def resolve_ports(*, base_port: int, count: int, ports: Sequence[int] | None) -> list[int]:
    """Explicit ``ports`` win; otherwise ``count`` consecutive ports (all 0 when base is 0)."""
    if ports:
        return list(ports)
    if count < 1:
        raise SimStartupError("count must be >= 1")
    return [0] * count if base_port == 0 else [base_port + i for i in range(count)]


async def serve_instances(
    *,
    host: str = "127.0.0.1",
    base_port: int = 8001,
    count: int = 1,
    profile: str | EngineConfig = DEFAULT_PROFILE,
    time_scale: float = 1.0,
    ports: Sequence[int] | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[SimCluster], None] | None = None,
    serve: Sequence[Sequence[str]] = (),
    api_key: str | None = None,
    **overrides: Any,
) -> None:
    """Serve ``count`` instances (or one per port in ``ports``) until SIGINT/SIGTERM or ``stop``.

    ``overrides`` are :class:`EngineConfig` / :class:`CostModel` fields (see ``make_config``).
    By default one ready line per instance is printed to stdout.
    """
    config = make_config(profile, time_scale=time_scale, **overrides)
    for served in serve:
        serving(config, served)  # validate before binding anything
    cluster = await start_instances(
        config=config,
        host=host,
        ports=resolve_ports(base_port=base_port, count=count, ports=ports),
        serve=serve,
        api_key=api_key,
    )
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        if on_ready is not None:
            on_ready(cluster)
        else:
            for member in cluster.members:
                print(ready_line(member), flush=True)
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await cluster.stop()
        print("vllm-sim stopped", file=sys.stderr, flush=True)
