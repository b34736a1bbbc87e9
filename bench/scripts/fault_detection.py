"""Time from an instance's fault to Envoy taking it out of the model cluster.

The fault tests (tests/test_reliability_*.py) assert only that it happens and that no
request fails; this measures how long it takes, against the bound the health-check
settings give: ``unhealthy_threshold x (interval + timeout) + 1 s`` of jitter.

Starts ``--instances`` simulated vLLM instances (one process each, so one can be
killed) and one Envoy with a static fleet on free 127.0.0.1 ports, then ``--rounds``
times, on instance ``round % instances``:

* ``hung``: ``POST /sim/fault {"mode": "hang"}`` (nothing answers, connections stay
  open), until Envoy's ``/clusters`` shows ``failed_active_health_check``; then clears
  the fault and waits until the instance passes again;
* ``killed``: SIGKILL of its process, until the same; then starts it again and waits.

Prints p50 and max per fault (JSON with ``--json``). No request load is sent.

    .venv/bin/python bench/scripts/fault_detection.py [--rounds 5] [--instances 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import start_envoy, start_module
from prefix_router.ops.procs import ManagedProcess, free_port

LIMIT_S = 60.0
"""Give up on one wait after this long (the bound is a few seconds)."""


def failing_checks(admin_port: int) -> dict[int, bool]:
    """Backend port -> Envoy marks it failed by active health checks."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{admin_port}/clusters?format=json", timeout=5
    ) as r:
        clusters = json.load(r)["cluster_statuses"]
    out: dict[int, bool] = {}
    for cluster in clusters:
        if cluster["name"] == "models":
            for h in cluster.get("host_statuses", []):
                port = int(h["address"]["socket_address"]["port_value"])
                out[port] = bool(h["health_status"].get("failed_active_health_check", False))
    return out


def seconds_until(check: Callable[[], bool], what: str) -> float:
    started = time.perf_counter()
    while not check():
        if time.perf_counter() - started > LIMIT_S:
            raise TimeoutError(f"not within {LIMIT_S} s: {what}")
        time.sleep(0.005)
    return time.perf_counter() - started


def start_sim(port: int, log_dir: Path) -> ManagedProcess:
    args = ["--ports", str(port), "--host", "127.0.0.1", "--time-scale", "20"]
    return start_module(f"sim-{port}", "vllm_sim", args, log_dir, ready_ports=[port])


def run(rounds: int, instances: int, log_dir: Path) -> dict[str, dict[str, float]]:
    config = RouterConfig()
    ports = [free_port() for _ in range(instances)]
    sims: dict[int, ManagedProcess] = {}
    envoy: ManagedProcess | None = None
    try:
        for port in ports:
            sims[port] = start_sim(port, log_dir)
        params = BootstrapParams(listen_port=free_port(), admin_port=free_port(), ext_proc=())
        fleet = Fleet.of([Instance("127.0.0.1", p) for p in ports])
        envoy = start_envoy(params, config, log_dir, fleet=fleet)
        admin = params.admin_port

        def passing(port: int) -> Callable[[], bool]:
            return lambda: failing_checks(admin).get(port) is False

        def failing(port: int) -> Callable[[], bool]:
            return lambda: failing_checks(admin).get(port) is True

        for port in ports:
            seconds_until(passing(port), f"{port} passes its first checks")
        results: dict[str, list[float]] = {"hung": [], "killed": []}
        with httpx.Client(timeout=10) as client:
            for n in range(rounds):
                port = ports[n % instances]
                fault = f"http://127.0.0.1:{port}/sim/fault"
                client.post(fault, json={"mode": "hang"}).raise_for_status()
                results["hung"].append(seconds_until(failing(port), f"{port} hung: out"))
                client.post(fault, json={"mode": "none"}).raise_for_status()
                seconds_until(passing(port), f"{port} back")

                started = time.perf_counter()
                sims[port].kill()
                seconds_until(failing(port), f"{port} killed: out")
                results["killed"].append(time.perf_counter() - started)
                sims[port] = start_sim(port, log_dir)
                seconds_until(passing(port), f"{port} restarted")
        hc = config.health_check
        bound = hc.unhealthy_threshold * (hc.interval_ms + hc.timeout_ms) / 1000 + 1.0
        return {
            kind: {
                "n": len(s),
                "p50_s": statistics.median(s),
                "max_s": max(s),
                "bound_s": bound,
            }
            for kind, s in results.items()
        }
    finally:
        if envoy is not None:
            envoy.stop()
        for proc in sims.values():
            proc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fault-detection-") as tmp:
        figures = run(args.rounds, args.instances, Path(tmp))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for kind, f in figures.items():
            print(
                f"{kind:7s} n={f['n']:.0f}  taken out: p50 {f['p50_s']:.2f} s  "
                f"max {f['max_s']:.2f} s  (bound {f['bound_s']:.1f} s)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
