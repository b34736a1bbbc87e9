"""Does throughput grow with more ext_proc processes behind one Envoy?

On a 2-core machine one uncapped ext_proc already leaves no core free (Envoy, the
backends and wrk take the other), so a second process cannot add anything measurable.
This script therefore caps every ext_proc at ``--cpu-cap`` cores with a cgroup CPU quota
(needs root) and measures, in one run on 127.0.0.1, requests/s at concurrency 16 through
one Envoy with 1, 2, ... ext_procs, plus each process's CPU time per request and its
share of the work (Envoy spreads ext_proc streams over the processes).

    sudo python bench/scripts/ext_proc_scaling.py [--max-ext-procs 3] [--cpu-cap 0.3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.scripts._harness import ROOT, CpuCap, chat_body, cpu_seconds, run_wrk
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import start_envoy, start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port


def measure(n: int, args: argparse.Namespace, fleet: Fleet, logs: Path) -> str:
    """One table row: ``n`` capped ext_procs behind a fresh Envoy."""
    started: list[ManagedProcess] = []
    caps: list[CpuCap] = []
    try:
        ports = [free_port() for _ in range(n)]
        ep_args = [a for i in fleet.instances for a in ("--backend", f"{i.address}:{i.port}")]
        if args.redis_url:
            ep_args += ["--redis-url", args.redis_url, "--namespace", "bench-scaling:"]
        for port in ports:
            proc = start_ext_proc(port, logs, args=ep_args)
            started.append(proc)
            if args.cpu_cap:
                caps.append(CpuCap(f"prefix-router-bench-{port}", args.cpu_cap))
                caps[-1].add(proc.pid)
        eps = tuple(("127.0.0.1", p) for p in ports)
        params = BootstrapParams(listen_port=free_port(), admin_port=free_port(), ext_proc=eps)
        started.append(start_envoy(params, RouterConfig(), logs, fleet=fleet, name=f"envoy-{n}"))
        url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
        body = chat_body(1024)
        run_wrk(url, body, connections=16, threads=2, seconds=2)  # warm up connections
        ext_procs = started[:n]
        before = [cpu_seconds(p.pid) for p in ext_procs]
        result = run_wrk(url, body, connections=16, threads=2, seconds=args.seconds)
        used = [cpu_seconds(p.pid) - b for p, b in zip(ext_procs, before, strict=True)]
        requests = result["rps"] * args.seconds
        per_request_us = sum(used) / requests * 1e6 if requests else float("nan")
        shares = " / ".join(f"{u / sum(used):.0%}" for u in used) if sum(used) else "-"
        cap = f"{args.cpu_cap:g}" if args.cpu_cap else "none"
        return (
            f"| {n} | {cap} | **{result['rps']:.0f}** | {result['p50']:.2f} | "
            f"{result['p99']:.2f} | {sum(used) / args.seconds:.2f} | {per_request_us:.0f} | "
            f"{shares} | {int(result['errors'])} |"
        )
    finally:
        for proc in reversed(started):
            proc.stop()
        for cap_group in caps:
            cap_group.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-ext-procs", type=int, default=3)
    parser.add_argument(
        "--cpu-cap", type=float, default=0.3, help="cores per ext_proc (cgroup quota); 0 = uncapped"
    )
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--redis-url", help="share counts through Redis (full decision path)")
    args = parser.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    ports = [free_port() for _ in range(3)]
    backends = start_module(
        "backends", "tests.support.echo_backend", [str(p) for p in ports], logs, ready_ports=ports
    )
    try:
        fleet = Fleet.of([Instance("127.0.0.1", p) for p in ports])
        rows = [measure(n, args, fleet, logs) for n in range(1, args.max_ext_procs + 1)]
    finally:
        backends.stop()
    table = "\n".join(
        [
            "1 KB chat bodies, concurrency 16, one Envoy (2 workers), counts "
            f"{'in Redis' if args.redis_url else 'in-process'}.",
            "",
            "| ext_procs | CPU cap each (cores) | req/s | p50 ms | p99 ms "
            "| ext_proc CPU used (cores) | ext_proc CPU us/request | work share per process "
            "| non-2xx |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    with (ROOT / "bench" / "results" / "ext_proc_scaling.md").open("a") as f:
        f.write(table + "\n\n")


if __name__ == "__main__":
    main()
