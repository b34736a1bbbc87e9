"""What the whole of ``prefix-router up`` adds to a request, seen by an outside client.

Issue 24 measured it this way: wrk against ``prefix-router up`` (Envoy, 2 ext_proc workers,
Redis, the control plane publishing the fleet over xDS) in front of 8 OpenAI-compatible
servers that answer at once, against calling one of those servers directly; then a tiny
request added +2.65 ms p50. ``data_plane_latency.py`` measures the parts (Envoy alone, each
ext_proc, a static fleet); this measures the product as a user starts it, so every piece a
request meets is in the figure: the dynamic cluster, two workers, the routing state in
Redis, the control plane's scrapes and writes running beside the traffic.

The servers are ``tests.support.echo_backend`` (one process, a port each, each answers at
once); ``up`` starts its own Redis (``redis-server`` must be on PATH). For 1 KB and 64 KB
OpenAI chat bodies: p50/p99 latency at concurrency 1, in ``--rounds`` rounds with the two
paths taking turns (each path's median round is kept), and requests/s at concurrency 16.
It prints a markdown table and appends it to ``bench/results/stack_latency.md``.

    python bench/scripts/stack_latency.py [--seconds 6] [--rounds 3] [--ext-procs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.scripts._harness import chat_body, latency_in_rounds, run_heading, run_wrk  # noqa: E402
from prefix_router.ops.launch import start_module  # noqa: E402
from prefix_router.ops.procs import free_port  # noqa: E402
from prefix_router.ops.up import Stack, resolve_settings  # noqa: E402

PATH = "/v1/chat/completions"


def routed_by_ext_proc(url: str, body: bytes) -> bool:
    """Whether a request through ``url`` reached a server with ``x-prefix-key`` set (the
    echo servers say which header they saw): ext_proc is in the request's path."""
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.load(answer).get("prefix_key") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ext-procs", type=int, default=2)
    parser.add_argument("--instances", type=int, default=8)
    args = parser.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="bench-stack-"))
    ports = [free_port() for _ in range(args.instances)]
    backends = start_module(
        "backends",
        "tests.support.echo_backend",
        [str(p) for p in ports],
        run_dir,
        ready_ports=ports,
    )
    argv = [
        "--run-dir", str(run_dir), "--port", str(free_port()), "--admin-port", str(free_port()),
        "--envoy-admin-port", str(free_port()), "--xds-port", str(free_port()),
        "--ext-procs", str(args.ext_procs),
        *(a for p in ports for a in ("--backend", f"http://127.0.0.1:{p}")),
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # up's own Redis
    settings, config = resolve_settings(argv, environ)
    stack = Stack(settings, config)
    try:
        stack.start()
        urls = {
            "direct": f"http://127.0.0.1:{ports[0]}{PATH}",
            "stack": f"http://{settings.host}:{settings.port}{PATH}",
        }
        if not routed_by_ext_proc(urls["stack"], chat_body(1024)):
            sys.exit("requests through the stack reach the servers without x-prefix-key")
        rows, ratios = [], []
        for size in (1024, 64 * 1024):
            body = chat_body(size)
            latency = latency_in_rounds(urls, body, seconds=args.seconds, rounds=args.rounds)
            rate = {
                name: run_wrk(url, body, connections=16, threads=2, seconds=args.seconds)
                for name, url in urls.items()
            }
            direct, stacked = latency["direct"], latency["stack"]
            for name, label in (("direct", "a server directly"), ("stack", "prefix-router up")):
                r, t = latency[name], rate[name]
                added = "-" if name == "direct" else f"**{r['p50'] - direct['p50']:+.2f}**"
                added_p99 = "-" if name == "direct" else f"{r['p99'] - direct['p99']:+.2f}"
                rows.append(
                    f"| {size // 1024} KB | {label} | {r['p50']:.2f} | {r['p99']:.2f} | {added} "
                    f"| {added_p99} | **{t['rps']:.0f}** | {int(r['errors'] + t['errors'])} |"
                )
            ratios.append(
                f"{size // 1024} KB: the stack adds {stacked['p50'] - direct['p50']:+.2f} ms p50 "
                f"at concurrency 1 and serves {rate['stack']['rps'] / rate['direct']['rps']:.2f}x "
                "a server's requests/s at 16"
            )
        table = "\n".join(
            [
                run_heading(),
                "",
                f"`prefix-router up` with {args.ext_procs} ext_proc workers and its own Redis, "
                f"in front of {args.instances} echo servers; concurrency 1: the median of "
                f"{args.rounds} rounds of {args.seconds} s, the paths taking turns",
                "",
                "| body | path | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s (c16) "
                "| errors |",
                "|---|---|---|---|---|---|---|---|",
                *rows,
                "",
                *(f"- {line}" for line in ratios),
            ]
        )
        print(table)
        with (ROOT / "bench" / "results" / "stack_latency.md").open("a") as out:
            out.write(table + "\n\n")
    finally:
        stack.stop()
        backends.stop()


if __name__ == "__main__":
    main()
