"""What ext_proc adds to a request: Envoy -> backend directly vs through ext_proc.

Starts, on 127.0.0.1: three echo backends, P prefix-router ext_proc processes on
each transport (our HTTP/2 server, the default, and grpcio), P bare ones
(``bare_ext_proc.py``: grpcio, continue, decide nothing), P floors (our HTTP/2 server
answering every message at once, ``ext_proc_round_trip.py --floor``) and five Envoys over
the same static fleet: one with the filter turned off, one through the bare ext_proc, one
through the floor, one through each of prefix-router's. The bare one is the yardstick
that does not depend on the machine: what a Python ext_proc on grpcio costs at all. The
floor splits what ours adds into what any ext_proc on our transport adds (Envoy's two
exchanges and the wake-ups) and what routing adds.
For 1 KB and 64 KB OpenAI chat bodies it measures, with wrk, latency p50/p99 at
concurrency 1 and requests/s at concurrency 16, and during the latter the ext_proc
processes' CPU time per request: its inverse is the requests/s one process serves
on a core of its own, a figure the other processes on the machine move much less
than they move requests/s (Envoy, wrk and the backends share its two cores). Envoy's
CPU a request is measured the same way on every path (what Envoy's own side of the two
ext_proc messages costs), and Redis's on the paths that use it when ``--redis-url``
names a Redis on this machine (its ``INFO`` gives the pid). It prints a markdown table
(also written to bench/results/data_plane_latency.md).

    python bench/scripts/data_plane_latency.py [--ext-procs 1] [--seconds 8] [--baseline DIR]

``--baseline DIR`` adds one more path: ext_proc run from another checkout (``git worktree
add DIR COMMIT``), on its default transport, so a change to the server is measured
against what it replaces in the same run. The last lines give the ratios the data path
is held to: ext_proc's added p50 over the bare one's at concurrency 1, the whole stack's
req/s over Envoy alone's at 16, and CPU a request over the baseline's.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.scripts._harness import (
    ROOT,
    chat_body,
    checkout_env,
    cpu_seconds,
    latency_in_rounds,
    run_heading,
    run_wrk,
)
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import delete_namespace, start_envoy, start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port

NAMESPACE = "bench-dp:"
"""The Redis key prefix of the ext_procs a run starts (deleted when it ends)."""

PATHS = {
    "direct": "Envoy alone",
    "bare": "bare Python ext_proc (grpcio)",
    "floor": "our server answering at once (no routing)",
    "ext_proc": "prefix-router ext_proc",
    "ext_proc_grpcio": "prefix-router ext_proc, grpcio transport",
}


USES_REDIS = frozenset({"ext_proc", "ext_proc_grpcio", "baseline"})
"""The paths whose ext_proc keeps its state in Redis when ``--redis-url`` is given."""


def local_redis_pid(url: str) -> int | None:
    """The pid of the Redis at ``url`` if it runs on this machine (its ``INFO`` says which
    process it is); None when it is elsewhere or does not answer."""
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=2) as client:
            pid = int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ext-procs", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--envoy-concurrency", type=int, default=2)
    parser.add_argument("--redis-url", help="share counts through Redis (full decision path)")
    parser.add_argument("--baseline", help="a checkout whose ext_proc is measured too")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure concurrency 1 in this many rounds, the paths taking turns in each, and "
        "report each path's median round (the machine drifts more than the paths differ)",
    )
    parser.add_argument(
        "--latency-only", action="store_true", help="concurrency 1 only (no req/s, no CPU)"
    )
    args = parser.parse_args()
    paths = dict(PATHS)
    if args.baseline:
        paths["baseline"] = f"prefix-router ext_proc at {Path(args.baseline).name} (baseline)"

    started: list[ManagedProcess] = []
    logs = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    try:
        ports = [free_port() for _ in range(3)]
        started.append(
            start_module(
                "backends",
                "tests.support.echo_backend",
                [str(p) for p in ports],
                logs,
                ready_ports=ports,
            )
        )
        fleet = Fleet.of([Instance("127.0.0.1", p) for p in ports])
        config = RouterConfig()
        ep_args = [a for p in ports for a in ("--backend", f"127.0.0.1:{p}")]
        if args.redis_url:
            ep_args += ["--redis-url", args.redis_url, "--namespace", NAMESPACE]

        def ours(transport: str) -> Callable[[int], ManagedProcess]:
            extra = ["--transport", transport]
            return lambda port: start_ext_proc(port, logs, args=[*ep_args, *extra])

        def bare(port: int) -> ManagedProcess:
            return start_module(
                f"bare-{port}", "bench.scripts.bare_ext_proc", [str(port)], logs, ready_ports=[port]
            )

        def baseline(port: int) -> ManagedProcess:
            return start_ext_proc(
                port, logs, args=ep_args, name=f"baseline-{port}", env=baseline_env
            )

        def floor(port: int) -> ManagedProcess:
            return start_module(
                f"floor-{port}",
                "bench.scripts.ext_proc_round_trip",
                ["--floor", str(port)],
                logs,
                ready_ports=[port],
            )

        baseline_env = checkout_env(args.baseline) if args.baseline else {}
        starters = {
            "bare": bare,
            "floor": floor,
            "ext_proc": ours("http2"),
            "ext_proc_grpcio": ours("grpcio"),
        }
        if args.baseline:
            starters["baseline"] = baseline
        pids: dict[str, list[int]] = {"direct": []}
        envoy_pids: dict[str, int] = {}
        redis_pid = local_redis_pid(args.redis_url) if args.redis_url else None
        urls = {}
        for name in paths:
            eps = [free_port() for _ in range(args.ext_procs)] if name in starters else []
            for port in eps:
                started.append(starters[name](port))
                pids.setdefault(name, []).append(started[-1].pid)
            params = BootstrapParams(
                listen_port=free_port(),
                admin_port=free_port(),
                ext_proc=tuple(("127.0.0.1", p) for p in eps),
            )
            started.append(
                start_envoy(
                    params,
                    config,
                    logs,
                    fleet=fleet,
                    name=f"envoy-{name}",
                    concurrency=args.envoy_concurrency,
                )
            )
            urls[name] = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
            envoy_pids[name] = started[-1].pid

        rows, ratios = [], []
        for size in (1024, 64 * 1024):
            body = chat_body(size)
            latency = latency_in_rounds(urls, body, seconds=args.seconds, rounds=args.rounds)
            rate, cpu_us, envoy_us, redis_us = {}, {}, {}, {}
            for name, url in urls.items():
                if args.latency_only:
                    continue
                redis = redis_pid if name in USES_REDIS else None
                watched = {
                    "ext_proc": pids[name],
                    "envoy": [envoy_pids[name]],
                    "redis": [] if redis is None else [redis],
                }
                before = {k: sum(cpu_seconds(pid) for pid in v) for k, v in watched.items()}
                rate[name] = run_wrk(url, body, connections=16, threads=2, seconds=args.seconds)
                served = rate[name]["rps"] * args.seconds
                used = {
                    k: (sum(cpu_seconds(pid) for pid in v) - before[k]) / served * 1e6
                    for k, v in watched.items()
                }
                cpu_us[name], envoy_us[name] = used["ext_proc"], used["envoy"]
                if redis is not None:
                    redis_us[name] = used["redis"]
            direct = latency["direct"]
            added_p50 = {n: latency[n]["p50"] - direct["p50"] for n in urls if n != "direct"}
            ratio = (
                f"{size // 1024} KB: ext_proc added p50 / bare's = "
                f"**{added_p50['ext_proc'] / added_p50['bare']:.2f}** (our server answering at "
                f"once: {added_p50['floor'] / added_p50['bare']:.2f}"
                + (
                    f"; the baseline: {added_p50['baseline'] / added_p50['bare']:.2f}"
                    if "baseline" in added_p50
                    else ""
                )
                + ")"
            )
            if not args.latency_only:
                ratio += (
                    f"; stack req/s (c16) / Envoy alone's = "
                    f"**{rate['ext_proc']['rps'] / rate['direct']['rps']:.2f}**"
                )
            if "baseline" in cpu_us:
                ratio += (
                    f"; CPU a request / baseline's = "
                    f"**{cpu_us['ext_proc'] / cpu_us['baseline']:.2f}**"
                )
            ratios.append(ratio)
            for name, label in paths.items():
                r, t = latency[name], rate.get(name)
                added = ["-", "-"]
                cpu = "-"
                if name != "direct":
                    added = [f"**{r[q] - direct[q]:+.2f}**" for q in ("p50", "p99")]
                    if name in cpu_us:
                        cpu = f"{cpu_us[name]:.0f} us = **{1e6 / cpu_us[name]:,.0f}**"
                redis_cpu = f"{redis_us[name]:.0f} us" if name in redis_us else "-"
                envoy_cpu = f"{envoy_us[name]:.0f} us" if name in envoy_us else "-"
                req_s = "-" if t is None else f"**{t['rps']:.0f}**"
                errors = int(r["errors"] + (0 if t is None else t["errors"]))
                rows.append(
                    f"| {size // 1024} KB | {label} | {r['p50']:.2f} | {r['p99']:.2f} | "
                    f"{added[0]} | {added[1]} | {req_s} | {cpu} | "
                    f"{envoy_cpu} | {redis_cpu} | {errors} |"
                )
        table = "\n".join(
            [
                run_heading(),
                "",
                f"ext_proc processes: {args.ext_procs}; Envoy workers: {args.envoy_concurrency}; "
                f"load store: {'Redis' if args.redis_url else 'in-process'}"
                + (
                    f"; concurrency 1: the median of {args.rounds} rounds of {args.seconds} s"
                    if args.rounds > 1
                    else ""
                ),
                "",
                "| body | path | p50 ms | p99 ms | added p50 ms | added p99 ms "
                "| req/s (c16) | ext_proc CPU a request = req/s a core | Envoy CPU a request "
                "| Redis CPU a request | non-2xx |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
                *rows,
                "",
                *(f"- {line}" for line in ratios),
            ]
        )
        print(table)
        out = ROOT / "bench" / "results" / "data_plane_latency.md"
        with out.open("a") as f:
            f.write(table + "\n\n")
    finally:
        for proc in reversed(started):
            proc.stop()
        if args.redis_url:
            delete_namespace(args.redis_url, NAMESPACE)


if __name__ == "__main__":
    main()
