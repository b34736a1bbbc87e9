"""Time from an admin API call to Envoy applying the change, over xDS.

Starts echo backends, the control plane and one Envoy (xDS bootstrap) on free
127.0.0.1 ports, with a throw-away Redis namespace, then makes ``--changes``
changes of two kinds and polls Envoy's admin ``/clusters?format=json`` every
millisecond or so until it shows each one:

* ``weight``: PATCH /instances/{id} weight 1 <-> 2 (EDS, and CDS: the ring size);
* ``cluster``: PATCH /config circuit_breakers.max_requests (CDS only);
* ``ext_proc``: PATCH /config prefix_length, until both of two ext_proc replicas
  (following the state in Redis) have logged the routing table of the new config
  version (the README's "every ext_proc replica follows within 1 s").

The clock starts just before the HTTP call and stops when Envoy's live state
(or each replica's log) shows the new value. Prints p50 and max per kind (and
JSON with ``--json``).

    .venv/bin/python bench/scripts/xds_latency.py [--changes 20] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from prefix_router.core.config import RouterConfig
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import start_envoy, start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port
from prefix_router.state.store import StateStore

TOKEN = "bench-token"


def clusters(admin_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{admin_port}/clusters?format=json", timeout=2
    ) as r:
        for c in json.load(r)["cluster_statuses"]:
            if c["name"] == "models":
                return dict(c)
    return {}


def weight_of(admin_port: int, port: int) -> int | None:
    for h in clusters(admin_port).get("host_statuses", []):
        if h["address"]["socket_address"]["port_value"] == port:
            return int(h["weight"])
    return None


def max_requests(admin_port: int) -> int | None:
    thresholds = clusters(admin_port).get("circuit_breakers", {}).get("thresholds", [])
    return int(thresholds[0]["max_requests"]) if thresholds else None


def timed(call: Callable[[], httpx.Response], applied: Callable[[], bool]) -> float:
    started = time.perf_counter()
    r = call()
    r.raise_for_status()
    while not applied():
        if time.perf_counter() - started > 10:
            raise TimeoutError("Envoy did not apply the change in 10 s")
        time.sleep(0.001)
    return time.perf_counter() - started


TABLE_LINE = re.compile(r"routing table: fleet v\d+ \(\d+ routable\), config v(\d+)")


def config_versions(log: Path) -> set[int]:
    """Config versions whose routing table an ext_proc replica has swapped in (its log)."""
    return {int(v) for v in TABLE_LINE.findall(log.read_text(errors="replace"))}


def timed_follow(api: httpx.Client, logs: list[Path], prefix_length: int) -> float:
    started = time.perf_counter()
    r = api.patch("/config", json={"prefix_length": prefix_length})
    r.raise_for_status()
    version = int(r.json()["version"])
    while not all(version in config_versions(log) for log in logs):
        if time.perf_counter() - started > 10:
            raise TimeoutError("an ext_proc replica did not follow the change in 10 s")
        time.sleep(0.001)
    return time.perf_counter() - started


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"n": len(ms), "p50_ms": statistics.median(ms), "max_ms": ms[-1], "min_ms": ms[0]}


def run(changes: int, redis_url: str, log_dir: Path) -> dict[str, dict[str, float]]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}:"
    started: list[ManagedProcess] = []
    ports = [free_port() for _ in range(3)]
    xds_port, admin_port, listen, envoy_admin = (free_port() for _ in range(4))
    fleet_file = log_dir / "fleet.yaml"
    fleet_file.write_text(
        yaml.safe_dump({"instances": [{"address": "127.0.0.1", "port": p} for p in ports]})
    )
    try:
        started.append(
            start_module("backends", "tests.support.echo_backend", [str(p) for p in ports],
                         log_dir, ready_ports=ports)
        )  # fmt: skip
        started.append(
            start_module(
                "control-plane",
                "prefix_router",
                ["control-plane", "--xds-port", str(xds_port), "--admin-port", str(admin_port),
                 "--redis-url", redis_url, "--namespace", namespace, "--fleet", str(fleet_file)],
                log_dir,
                ready_ports=[xds_port, admin_port],
                env={"PREFIX_ROUTER_ADMIN_TOKEN": TOKEN},
            )
        )  # fmt: skip
        params = BootstrapParams(
            listen_port=listen, admin_port=envoy_admin, ext_proc=(), xds=("127.0.0.1", xds_port)
        )
        started.append(start_envoy(params, RouterConfig(), log_dir))
        replicas = [
            start_ext_proc(
                free_port(),
                log_dir,
                args=["--redis-url", redis_url, "--namespace", namespace],
                name=f"ext_proc-{n}",
            )
            for n in range(2)
        ]
        started += replicas
        deadline = time.monotonic() + 10
        while weight_of(envoy_admin, ports[0]) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("Envoy never got the fleet")
            time.sleep(0.01)
        results: dict[str, list[float]] = {"weight": [], "cluster": [], "ext_proc": []}
        with httpx.Client(
            base_url=f"http://127.0.0.1:{admin_port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        ) as api:
            target = f"127.0.0.1:{ports[0]}"
            for i in range(changes):
                w = 2 if i % 2 == 0 else 1
                results["weight"].append(
                    timed(
                        lambda w=w: api.patch(f"/instances/{target}", json={"weight": w}),  # type: ignore[misc]
                        lambda w=w: weight_of(envoy_admin, ports[0]) == w,  # type: ignore[misc]
                    )
                )
                limit = 50_000 + i
                results["cluster"].append(
                    timed(
                        lambda n=limit: api.patch(  # type: ignore[misc]
                            "/config", json={"circuit_breakers": {"max_requests": n}}
                        ),
                        lambda n=limit: max_requests(envoy_admin) == n,  # type: ignore[misc]
                    )
                )
                logs = [r.log_path for r in replicas]
                results["ext_proc"].append(timed_follow(api, logs, 1000 + i % 2))
                time.sleep(0.05)
        return {kind: summary(s) for kind, s in results.items()}
    finally:
        for proc in reversed(started):
            proc.stop()
        asyncio.run(_delete(redis_url, namespace))


async def _delete(redis_url: str, namespace: str) -> None:
    store = StateStore.from_url(redis_url, namespace)
    try:
        await store.delete_namespace()
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--changes", type=int, default=20)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xds-latency-") as tmp:
        figures = run(args.changes, args.redis_url, Path(tmp))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for kind, f in figures.items():
            print(
                f"{kind:8s} n={f['n']:.0f}  p50 {f['p50_ms']:.1f} ms  "
                f"max {f['max_ms']:.1f} ms  (min {f['min_ms']:.1f} ms)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
