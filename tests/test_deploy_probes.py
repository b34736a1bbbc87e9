"""The liveness probes of deploy/k8s/ and the healthchecks of compose/, run for real.

Each component is started on 127.0.0.1, and every probe the files give it is run the way
the kubelet (or Docker) runs it: ``exec`` / ``CMD`` commands as written (only the ports
mapped to free ones), ``httpGet`` and ``grpc`` as requests to the container port, each
bounded by the probe's ``timeoutSeconds`` (Docker: ``timeout``), a success being exit 0,
an HTTP status 200-399 or SERVING. Then the process is frozen with SIGSTOP, which is what
a hung process looks like from outside: its kernel still accepts connections, nothing
answers. Every probe must fail then (a TCP probe would pass), and pass again after
SIGCONT. The failures cannot be flaky: a stopped process never answers at any timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_router.ops.launch import start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.envoy_probe import start_envoy_with_probe_listener
from tests.support.wait import wait_until
from tests.test_deploy_compose import COMPOSE_DIR, load_compose
from tests.test_deploy_k8s import container

pytestmark = pytest.mark.e2e

Probe = Callable[[], bool]


def _map_ports(text: str, ports: dict[int, int]) -> str:
    for declared, real in ports.items():
        text = re.sub(rf"(127\.0\.0\.1:|-p ){declared}\b", rf"\g<1>{real}", text)
    return text


def _map_argv(argv: list[str], ports: dict[int, int]) -> list[str]:
    """Ports in ``127.0.0.1:PORT``, ``-p PORT`` inside an argument, or ``-p``, ``PORT``."""
    out = [_map_ports(a, ports) for a in argv]
    for i in range(1, len(out)):
        if out[i - 1] == "-p" and out[i].isdigit() and int(out[i]) in ports:
            out[i] = str(ports[int(out[i])])
    return out


def _run(argv: list[str], ports: dict[int, int], timeout: float) -> bool:
    """An exec probe: exit 0 within ``timeout``; past it the runner kills it (a failure)."""
    command = _map_argv(argv, ports)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    try:
        return subprocess.run(command, capture_output=True, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _http_get(port: int, path: str, timeout: float) -> bool:
    try:
        status = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=timeout).status_code
    except httpx.HTTPError:
        return False
    return 200 <= status < 400


def _grpc_serving(port: int, timeout: float) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _port_number(c: dict[str, Any], ref: int | str) -> int:
    if isinstance(ref, int):
        return ref
    (number,) = [p["containerPort"] for p in c.get("ports", []) if p["name"] == ref]
    return int(number)


def k8s_probe(c: dict[str, Any], kind: str, ports: dict[int, int]) -> Probe:
    """``kind`` (livenessProbe, ...) of container ``c`` as the kubelet runs it."""
    spec = c[kind]
    timeout = float(spec["timeoutSeconds"])
    if "exec" in spec:
        return lambda: _run(spec["exec"]["command"], ports, timeout)
    if "httpGet" in spec:
        port = ports[_port_number(c, spec["httpGet"]["port"])]
        return lambda: _http_get(port, spec["httpGet"]["path"], timeout)
    if "grpc" in spec:
        port = ports[_port_number(c, spec["grpc"]["port"])]
        return lambda: _grpc_serving(port, timeout)
    raise AssertionError(f"{c['name']} {kind}: no exec, httpGet or grpc probe: {spec}")


def _seconds(text: str) -> float:
    assert text.endswith("s"), text
    return float(text[:-1])


def compose_check(service: str, ports: dict[int, int]) -> Probe:
    check = load_compose({})["services"][service]["healthcheck"]
    assert check["test"][0] == "CMD", f"{service}: exec form, no shell"
    return lambda: _run(check["test"][1:], ports, _seconds(check["timeout"]))


@dataclass
class Case:
    proc: ManagedProcess
    probes: dict[str, Probe]


def _all_pass(probes: dict[str, Probe]) -> dict[str, bool]:
    with ThreadPoolExecutor(len(probes)) as pool:
        futures = {name: pool.submit(probe) for name, probe in probes.items()}
        return {name: future.result() for name, future in futures.items()}


def check_catches_a_hang(cases: dict[str, Case]) -> None:
    """Every probe passes, fails while its process is stopped, and passes again.

    All processes are frozen at once and their probes run side by side, so the suite waits
    for the longest probe timeout once, not for each.
    """
    probes = {
        f"{name} {label}": probe
        for name, case in cases.items()
        for label, probe in case.probes.items()
    }
    wait_until(lambda: all(_all_pass(probes).values()), 60, "every probe passes")
    for case in cases.values():
        os.killpg(case.proc.pid, signal.SIGSTOP)
    try:
        frozen = _all_pass(probes)
    finally:
        for case in cases.values():
            os.killpg(case.proc.pid, signal.SIGCONT)
    passed = sorted(name for name, ok in frozen.items() if ok)
    assert not passed, f"passed while the process was stopped: {passed}"
    wait_until(lambda: all(_all_pass(probes).values()), 60, "every probe passes again")


def ext_proc_case(procs: ProcessReaper, log_dir: Path) -> Case:
    port = free_port()
    proc = procs.add(start_ext_proc(port, log_dir, args=["--backend", "127.0.0.1:1"]))
    sidecar = container("envoy", "ext-proc")
    ports = {50051: port}
    return Case(
        proc,
        {
            "k8s liveness": k8s_probe(sidecar, "livenessProbe", ports),
            "k8s startup": k8s_probe(sidecar, "startupProbe", ports),
            "compose": compose_check("ext-proc", ports),
        },
    )


def envoy_case(procs: ProcessReaper, log_dir: Path) -> Case:
    started = start_envoy_with_probe_listener(procs, log_dir)
    proc, probe = started.process, started.probe
    envoy = container("envoy", "envoy")
    ports = {9902: probe}
    return Case(
        proc,
        {
            "k8s liveness": k8s_probe(envoy, "livenessProbe", ports),
            "k8s readiness": k8s_probe(envoy, "readinessProbe", ports),
            "compose": compose_check("envoy", ports),
        },
    )


def control_plane_case(procs: ProcessReaper, log_dir: Path, namespace: str) -> Case:
    xds, admin, metrics = free_port(), free_port(), free_port()
    proc = procs.add(
        start_module(
            "control-plane",
            "prefix_router",
            [
                "control-plane",
                "--xds-port",
                str(xds),
                "--admin-port",
                str(admin),
                "--metrics-port",
                str(metrics),
                "--redis-url",
                REDIS_URL,
                "--namespace",
                namespace,
                "--fleet-scrape-interval",
                "0",
                "--no-health-probe",
            ],
            log_dir,
            ready_ports=[xds, admin, metrics],
            env={"PREFIX_ROUTER_ADMIN_TOKEN": "t"},
        )
    )
    cp = container("control-plane")
    ports = {18000: xds, 8081: admin, 9103: metrics}
    return Case(
        proc,
        {
            "k8s liveness": k8s_probe(cp, "livenessProbe", ports),
            "k8s readiness": k8s_probe(cp, "readinessProbe", ports),
            "compose": compose_check("control-plane", ports),
        },
    )


def start_redis(procs: ProcessReaper, log_dir: Path, acl_file: Path) -> tuple[ManagedProcess, int]:
    """A Redis of this test's own (never freeze the shared one) with ``acl_file``."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is installed by scripts/ensure-test-services"
    port = free_port()
    proc = procs.add(
        ManagedProcess(
            "redis",
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--aclfile",
                str(acl_file),
            ],
            log_dir / "redis.log",
        ).start()
    )
    wait_until(lambda: _run(["redis-cli", "-p", str(port), "ping"], {}, 5), 30, "redis answers")
    return proc, port


def redis_case(procs: ProcessReaper, log_dir: Path) -> Case:
    proc, port = start_redis(procs, log_dir, COMPOSE_DIR / "redis-users.acl.dev")
    redis = container("redis")
    ports = {6379: port}
    return Case(
        proc,
        {
            "k8s liveness": k8s_probe(redis, "livenessProbe", ports),
            "k8s readiness": k8s_probe(redis, "readinessProbe", ports),
            "compose": compose_check("redis", ports),
        },
    )


def simulator_case(procs: ProcessReaper, log_dir: Path) -> Case:
    port = free_port()
    proc = procs.add(
        start_module("sim", "vllm_sim", ["--ports", str(port)], log_dir, ready_ports=[port])
    )
    return Case(proc, {"compose": compose_check("sim-1", {8000: port})})


def test_ports_are_mapped_wherever_a_probe_names_them() -> None:
    ports = {6379: 1234, 50051: 4321}
    assert _map_argv(["redis-cli", "-p", "6379", "ping"], ports)[2] == "1234"
    assert _map_argv(["sh", "-c", "redis-cli -p 6379 ping"], ports)[2] == "redis-cli -p 1234 ping"
    assert "127.0.0.1:4321'" in _map_argv(["python", "-c", "c('127.0.0.1:50051')"], ports)[2]
    assert _map_argv(["x", "-p", "16379"], ports)[2] == "16379"


def test_every_liveness_probe_and_healthcheck_fails_while_its_process_hangs(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    """Envoy, ext_proc, the control plane, Redis (k8s and compose) and the simulator (compose)."""
    check_catches_a_hang(
        {
            "ext_proc": ext_proc_case(procs, log_dir),
            "envoy": envoy_case(procs, log_dir),
            "control plane": control_plane_case(procs, log_dir, namespace),
            "redis": redis_case(procs, log_dir),
            "simulator": simulator_case(procs, log_dir),
        }
    )
