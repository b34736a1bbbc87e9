"""A real data path on 127.0.0.1: echo backends, ext_proc, Envoy with a static fleet."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import start_envoy, start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port
from tests.conftest import ProcessReaper


@dataclass
class StaticStack:
    url: str
    admin_port: int
    fleet: Fleet
    config: RouterConfig
    ext_proc_ports: list[int]
    ext_procs: list[ManagedProcess] = field(default_factory=list)
    ext_proc_args: list[str] = field(default_factory=list)
    envoy: ManagedProcess | None = None
    backends: ManagedProcess | None = None


def start_static_stack(
    procs: ProcessReaper,
    log_dir: Path,
    *,
    backends: int = 3,
    ext_procs: int = 1,
    config: RouterConfig | None = None,
    weights: Sequence[int] | None = None,
    hash_keys: Sequence[str | None] | None = None,
    addresses: Sequence[str] | None = None,
    models: Sequence[Sequence[str]] | None = None,
    start_ext_procs: bool = True,
    sim_args: Sequence[str] | None = None,
    ext_proc_args: Sequence[str] = (),
    max_downstream_connections: int | None = None,
    envoy_concurrency: int = 2,
    grpc_client_idle_s: int | None = None,
    ext_proc_max_concurrent_streams: int | None = None,
) -> StaticStack:
    """Backends are echo servers, or simulated vLLM instances when ``sim_args`` is given.

    ``grpc_client_idle_s``: Envoy drops a worker's cached ext_proc client after this long
    without a new stream (None: the bootstrap's default); with ``envoy_concurrency`` 1
    every stream is on the one worker (tests/test_long_responses.py)."""
    config = config or RouterConfig()
    ports = [free_port() for _ in range(backends)]
    weights = weights or [1] * backends
    hash_keys = hash_keys or [None] * backends
    addresses = addresses or ["127.0.0.1"] * backends
    models = models or [()] * backends
    fleet = Fleet.of(
        [
            Instance(a, p, weight=w, hash_key=k, models=tuple(m))
            for a, p, w, k, m in zip(addresses, ports, weights, hash_keys, models, strict=True)
        ]
    )
    stack = StaticStack(
        url="",
        admin_port=free_port(),
        fleet=fleet,
        config=config,
        ext_proc_ports=[free_port() for _ in range(ext_procs)],
    )
    if sim_args is None:
        module, args = "tests.support.echo_backend", [str(p) for p in ports]
    else:
        module, args = "vllm_sim", ["--ports", ",".join(map(str, ports)), *sim_args]
    stack.backends = procs.add(start_module("backends", module, args, log_dir, ready_ports=ports))
    stack.ext_proc_args = list(ext_proc_args)
    config_file = log_dir / "routing.json"
    config_file.write_text(json.dumps(config.to_json_dict()))
    if start_ext_procs:
        for port in stack.ext_proc_ports:
            stack.ext_procs.append(procs.add(start_ext_proc_for(stack, port, log_dir)))
    listen_port = free_port()
    params = BootstrapParams(
        listen_port=listen_port,
        admin_port=stack.admin_port,
        ext_proc=tuple(("127.0.0.1", p) for p in stack.ext_proc_ports),
        max_downstream_connections=max_downstream_connections,
        **(
            {}
            if ext_proc_max_concurrent_streams is None
            else {"ext_proc_max_concurrent_streams": ext_proc_max_concurrent_streams}
        ),
    )
    if grpc_client_idle_s is not None:
        params = replace(params, grpc_client_idle_s=grpc_client_idle_s)
    stack.envoy = procs.add(
        start_envoy(params, config, log_dir, fleet=fleet, concurrency=envoy_concurrency)
    )
    stack.url = f"http://127.0.0.1:{listen_port}"
    return stack


def start_ext_proc_for(stack: StaticStack, port: int, log_dir: Path) -> ManagedProcess:
    args = ["--config", str(log_dir / "routing.json"), *stack.ext_proc_args]
    for inst in stack.fleet.instances:
        args += ["--backend", inst.to_url()]
    return start_ext_proc(port, log_dir, args=args)


def envoy_stats(stack: StaticStack, pattern: str) -> dict[str, int]:
    """Envoy's counters and gauges whose name matches the regex ``pattern``."""
    query = urllib.parse.urlencode({"format": "json", "filter": pattern})
    with urllib.request.urlopen(
        f"http://127.0.0.1:{stack.admin_port}/stats?{query}", timeout=5
    ) as r:
        return {s["name"]: int(s["value"]) for s in json.load(r)["stats"] if "value" in s}
