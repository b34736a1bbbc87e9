"""A real xDS data path on 127.0.0.1: echo backends, control plane, ext_proc following Redis,
Envoy learning its cluster over ADS. Every process goes through the ``procs`` reaper."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from prefix_router.core.config import RouterConfig
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import start_envoy, start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.wait import wait_until

TOKEN = "test-admin-token"


@dataclass
class XdsStack:
    namespace: str
    log_dir: Path
    url: str = ""
    admin_url: str = ""
    envoy_admin_port: int = 0
    xds_port: int = 0
    admin_port: int = 0
    backend_ports: list[int] = field(default_factory=list)
    control_plane: ManagedProcess | None = None
    envoy: ManagedProcess | None = None
    ext_procs: list[ManagedProcess] = field(default_factory=list)
    cp_args: list[str] = field(default_factory=list)
    backend_procs: dict[int, ManagedProcess] = field(default_factory=dict)
    """Backend port -> its own process, when started with ``backend_processes=True``."""

    def admin(self, *, token: str | None = TOKEN, timeout: float = 10) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.admin_url, headers=headers, timeout=timeout)

    def envoy_json(self, path: str) -> Any:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.envoy_admin_port}{path}", timeout=5
        ) as r:
            return json.load(r)

    def envoy_hosts(self) -> dict[str, dict[str, Any]]:
        """Envoy's hosts of the ``models`` cluster: ``ip:port`` -> host status."""
        hosts: dict[str, dict[str, Any]] = {}
        for cluster in self.envoy_json("/clusters?format=json").get("cluster_statuses", []):
            if cluster["name"] != "models":
                continue
            for h in cluster.get("host_statuses", []):
                sa = h["address"]["socket_address"]
                hosts[f"{sa['address']}:{sa['port_value']}"] = h
        return hosts

    def envoy_cluster(self) -> dict[str, Any] | None:
        """The dynamic ``models`` cluster Envoy runs (config dump: version_info, cluster)."""
        for cfg in self.envoy_json("/config_dump?resource=dynamic_active_clusters")["configs"]:
            if cfg["cluster"]["name"] == "models":
                return dict(cfg)
        return None

    def control_plane_connected(self) -> bool:
        """Envoy's own view of its xDS stream (stat ``control_plane.connected_state``)."""
        stats = self.envoy_json("/stats?format=json&filter=^control_plane.connected_state$")
        return bool(stats["stats"][0]["value"])

    def converged(self) -> bool:
        """Every connected Envoy ACKed the published snapshot (CDS and EDS) and every
        ext_proc replica logged the routing table of the current fleet and config: from
        here on, a new request is routed on the state the admin API shows."""
        with self.admin() as admin:
            status = admin.get("/status").json()
        published = status["published_snapshot"]
        clients = [c for c in status["xds_clients"] if c["connected"]]
        if published is None or not clients:
            return False
        if any(c["acked"].get(t) != published for c in clients for t in ("cds", "eds")):
            return False
        want = (status["fleet_version"], status["config_version"])
        return all(tables_applied(p)[-1:] == [want] for p in self.ext_procs)

    def start_control_plane(self, procs: ProcessReaper) -> ManagedProcess:
        self.control_plane = procs.add(
            start_module(
                "control-plane",
                "prefix_router",
                ["control-plane", *self.cp_args],
                self.log_dir,
                ready_ports=[self.xds_port, self.admin_port],
                env={"PREFIX_ROUTER_ADMIN_TOKEN": TOKEN},
            )
        )
        return self.control_plane


TABLE_LINE = re.compile(r"routing table: fleet v(\d+) \(\d+ routable\), config v(\d+)")


def tables_applied(ext_proc: ManagedProcess) -> list[tuple[int, int]]:
    """(fleet version, config version) of every routing table ``ext_proc`` swapped in, in
    order, from its log (ext_proc/state_follower.py logs each one)."""
    try:
        text = ext_proc.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [(int(f), int(c)) for f, c in TABLE_LINE.findall(text)]


def start_backends(procs: ProcessReaper, log_dir: Path, ports: Sequence[int], name: str) -> None:
    procs.add(
        start_module(
            name, "tests.support.echo_backend", [str(p) for p in ports], log_dir, ready_ports=ports
        )
    )


def start_xds_stack(
    procs: ProcessReaper,
    log_dir: Path,
    namespace: str,
    *,
    backends: int = 3,
    spare_backends: int = 0,
    config: RouterConfig | None = None,
    envoy_nodes: int = 1,
    extra_cp_args: Sequence[str] = (),
    backend_processes: bool = False,
    ext_procs: int = 1,
    sim_args: Sequence[str] | None = None,
    models: Sequence[Sequence[str]] = (),
) -> tuple[XdsStack, list[ManagedProcess]]:
    """Start the stack with ``backends`` in the fleet and ``spare_backends`` running outside it.

    Backends are echo servers, or simulated vLLM instances (one process) when ``sim_args``
    is given. Every Envoy spreads its ext_proc streams over ``ext_procs`` replicas.
    Returns the stack and every Envoy (``envoy_nodes`` of them, node ids ``envoy-0``...).
    ``models``: what each backend in the fleet declares it serves (in port order).
    """
    stack = XdsStack(namespace=namespace, log_dir=log_dir)
    stack.backend_ports = [free_port() for _ in range(backends + spare_backends)]
    if sim_args is not None:
        ports = stack.backend_ports
        args = ["--ports", ",".join(map(str, ports)), *sim_args]
        procs.add(start_module("backends", "vllm_sim", args, log_dir, ready_ports=ports))
    elif backend_processes:  # one process each, so a test can kill one
        for port in stack.backend_ports:
            stack.backend_procs[port] = procs.add(
                start_module(
                    f"backend-{port}",
                    "tests.support.echo_backend",
                    [str(port)],
                    log_dir,
                    ready_ports=[port],
                )
            )
    else:
        start_backends(procs, log_dir, stack.backend_ports, "backends")
    fleet_file = log_dir / "fleet.yaml"
    doc: dict[str, Any] = {
        "instances": [{"address": "127.0.0.1", "port": p} for p in stack.backend_ports[:backends]]
    }
    for instance, served in zip(doc["instances"], models, strict=False):
        instance["models"] = list(served)
    if config is not None:
        doc["routing"] = config.to_json_dict()
    fleet_file.write_text(yaml.safe_dump(doc))
    stack.xds_port, stack.admin_port = free_port(), free_port()
    stack.admin_url = f"http://127.0.0.1:{stack.admin_port}"
    stack.cp_args = [
        "--xds-port",
        str(stack.xds_port),
        "--admin-port",
        str(stack.admin_port),
        "--redis-url",
        REDIS_URL,
        "--namespace",
        namespace,
        "--fleet",
        str(fleet_file),
        *extra_cp_args,
    ]
    stack.start_control_plane(procs)
    ext_proc_ports = [free_port() for _ in range(ext_procs)]
    for port in ext_proc_ports:
        stack.ext_procs.append(
            procs.add(
                start_ext_proc(
                    port, log_dir, args=["--redis-url", REDIS_URL, "--namespace", namespace]
                )
            )
        )
    envoys = []
    for n in range(envoy_nodes):
        listen, admin = free_port(), free_port()
        params = BootstrapParams(
            listen_port=listen,
            admin_port=admin,
            ext_proc=tuple(("127.0.0.1", p) for p in ext_proc_ports),
            xds=("127.0.0.1", stack.xds_port),
            node_id=f"envoy-{n}",
        )
        envoy = procs.add(start_envoy(params, config or RouterConfig(), log_dir, name=f"envoy-{n}"))
        envoys.append(envoy)
        if n == 0:
            stack.envoy = envoy
            stack.url = f"http://127.0.0.1:{listen}"
            stack.envoy_admin_port = admin
    wait_until(lambda: len(stack.envoy_hosts()) == backends, 30, "Envoy got its hosts over xDS")
    return stack, envoys
