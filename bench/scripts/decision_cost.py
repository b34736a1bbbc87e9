"""What one routing decision costs ext_proc, this checkout against another (``--baseline``).

For 1 KB and 16 KB OpenAI chat bodies (the same system prompt, a user message that differs
per request) it runs the path ext_proc runs per request: key, decision, reservation and
release (``RequestRouter.route`` then ``finish``), on in-process state and with the fleet's
state in Redis, and reports:

* decision latency p50/p99 (us), one request at a time;
* CPU per request (us of process CPU time over the same requests: what a replica pays,
  whatever else the machine runs), one at a time and with 16 concurrent requests (which
  share round trips, as under load);
* with ``--callgrind``, instructions per request (valgrind's callgrind, the difference
  between two runs of different lengths, so start-up cancels): the figure that does not
  move with the machine's load;
* with ``--evict-mb N``, p50 latency again with N MB of memory written between requests,
  which evicts the CPU's caches as the other processes of a request's path do (Envoy, the
  client, the instance) while ext_proc waits for its next message: through the stack at
  concurrency 1 a request is routed with cold caches, and costs what this column says, not
  what the hot loop does (docs/data-path.md).

Each (checkout, store, body) runs in a child process of its own, whose ``prefix_router``
is imported from that checkout (``_harness.checkout_env``, as ``data_plane_latency.py
--baseline`` does), so both run on this interpreter and its libraries. The rounds alternate between
the checkouts and the median round is kept, so a busy moment on the machine hits both.

    python bench/scripts/decision_cost.py [--baseline DIR] [--redis-url URL] [--n 3000]
        [--rounds 3] [--callgrind] [--evict-mb 4] [--before DIR]
        [--out bench/results/decision_cost.md]

``DIR`` is a checkout of the old router (``git worktree add /work/wt-old-cost e67dc7e``).
8 instances; every count taken is given back and the child's namespace deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

PATH = "/v1/chat/completions"
SIZES = (1024, 16384)
CONCURRENT = 16
WARMUP = 300


def _bodies(template: bytes, n: int) -> list[bytes]:
    """``n`` bodies that share everything up to the user message, which differs."""
    head, _, tail = template.rpartition(b'"hello"')
    return [head + b'"hello %08d"' % i + tail for i in range(n)]


async def _child(args: argparse.Namespace) -> dict[str, float]:
    """One measurement in this process, on whatever ``prefix_router`` is importable."""
    import uvloop  # noqa: F401 - ext_proc's loop; imported here to fail early

    from ext_proc.router import RequestRouter
    from prefix_router.core.config import RouterConfig
    from prefix_router.core.fleet import Fleet, Instance
    from prefix_router.core.table import RoutingTable

    try:  # this checkout's names, then the old router's
        from prefix_router.state.routing import InProcessStore as Memory
        from prefix_router.state.routing.redis_store import RedisStore as Shared
    except ImportError:
        from prefix_router.state.loads import InMemoryLoadStore as Memory  # type: ignore
        from prefix_router.state.loads.redis_store import (  # type: ignore
            RedisLoadStore as Shared,
        )

    table = RoutingTable.build(
        Fleet.of([Instance("10.0.0.1", 8000 + i) for i in range(8)]), RouterConfig()
    )
    extra = args.n // 2 if args.evict_mb else 0  # new bodies for the cold pass
    bodies = _bodies(Path(args.body).read_bytes(), WARMUP + args.n + extra)
    namespace = f"bench-cost-{uuid.uuid4().hex[:8]}:"
    store = (
        Memory()
        if args.store == "memory"
        else await Shared.connect(args.redis_url, namespace=namespace, timeout_s=args.timeout_s)
    )
    router = RequestRouter(table, store)
    degraded = 0

    async def one(body: bytes) -> float:
        nonlocal degraded
        started = time.perf_counter()
        result = await router.route(body, path=PATH, tenant="t")
        took = time.perf_counter() - started
        router.finish(result)
        degraded += result.decision.outcome == "ring_only"
        return took

    async def worker(bodies: list[bytes]) -> None:
        for body in bodies:
            await one(body)

    try:
        for body in bodies[:WARMUP]:
            await one(body)
        await asyncio.sleep(0.01)
        measured = bodies[WARMUP : WARMUP + args.n]
        out: dict[str, float] = {}
        if args.concurrency == 1:
            cpu = time.process_time()
            samples = [await one(body) for body in measured]
            out["cpu_us"] = (time.process_time() - cpu) / len(measured) * 1e6
            samples.sort()
            out["p50_us"] = statistics.median(samples) * 1e6
            out["p99_us"] = samples[int(0.99 * (len(samples) - 1))] * 1e6
            if args.evict_mb:
                junk = bytearray(args.evict_mb << 20)
                cold = []
                for body in bodies[WARMUP + args.n :]:
                    junk[:] = bytes(len(junk))  # what the path's other processes do to caches
                    cold.append(await one(body))
                out["p50_cold_us"] = statistics.median(cold) * 1e6
        else:
            cpu = time.process_time()
            c = args.concurrency
            await asyncio.gather(*(worker(measured[i::c]) for i in range(c)))
            out["cpu_us"] = (time.process_time() - cpu) / len(measured) * 1e6
        out["degraded"] = degraded
        return out
    finally:
        await store.close()
        if args.store == "redis":
            import redis.asyncio as aioredis

            cleaner = aioredis.Redis.from_url(args.redis_url)
            keys = [k async for k in cleaner.scan_iter(match=f"{namespace}*")]
            if keys:
                await cleaner.delete(*keys)
            await cleaner.aclose()


def _child_command(tree: Path, extra: list[str], callgrind: Path | None) -> list[str]:
    cmd = [sys.executable, __file__, "--child", *extra]
    if callgrind is not None:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}", *cmd]
    return cmd


def _result(cmd: list[str], returncode: int, stdout: str, stderr: str) -> dict[str, float]:
    if returncode != 0:
        sys.exit(f"child {cmd} failed:\n{stderr[-3000:]}")
    measured: dict[str, float] = json.loads(stdout.strip().splitlines()[-1])
    return measured


@functools.cache
def _checkout_env(tree: Path) -> dict[str, str]:
    """Checked once per checkout, not once per child (each check starts a Python)."""
    # imported here, in the parent: a child imports nothing of bench from its checkout
    from bench.scripts._harness import checkout_env

    return checkout_env(tree)


def _run_child(tree: Path, extra: list[str]) -> dict[str, float]:
    cmd = _child_command(tree, extra, None)
    env = {**os.environ, **_checkout_env(tree)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    return _result(cmd, done.returncode, done.stdout, done.stderr)


def _instructions(tree: Path, extra: list[str], n: int) -> float:
    """Instructions per request under callgrind: the difference between a run of ``n``
    and one of ``2n`` requests (both at once: callgrind counts, whatever the load)."""
    env = {**os.environ, **_checkout_env(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"callgrind-{runs}.out" for runs in (n, 2 * n)]
        cmds = [
            _child_command(tree, [*extra, "--n", str(runs), "--timeout-s", "2"], out)
            for runs, out in zip((n, 2 * n), outs, strict=True)
        ]
        procs = [
            subprocess.Popen(
                cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for cmd in cmds
        ]
        counts = []
        for cmd, proc, out in zip(cmds, procs, outs, strict=True):
            stdout, stderr = proc.communicate(timeout=1800)
            _result(cmd, proc.returncode, stdout, stderr)
            summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
            assert summary is not None, "callgrind wrote no summary"
            counts.append(int(summary.group(1)))
    return (counts[1] - counts[0]) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", help="a checkout of the router to compare with ('old')")
    parser.add_argument("--before", help="one more checkout, e.g. before a change ('before')")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--callgrind", action="store_true", help="also count instructions")
    parser.add_argument("--callgrind-n", type=int, default=300)
    parser.add_argument(
        "--evict-mb", type=int, default=0, help="also p50 with this many MB written between"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", choices=("memory", "redis"), default="redis")
    parser.add_argument("--body", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=0.1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import uvloop

        print(json.dumps(uvloop.run(_child(args))))
        return

    from bench.scripts._harness import ROOT, chat_body

    here = ROOT
    trees = {"new": here}
    if args.before:
        trees = {"before": Path(args.before).resolve(), **trees}
    if args.baseline:
        trees = {"old": Path(args.baseline).resolve(), **trees}
    out_path = args.out or ROOT / "bench" / "results" / "decision_cost.md"
    rows: dict[tuple[str, str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bodies = {}
        for size in SIZES:
            bodies[size] = Path(tmp) / f"body-{size}.json"
            bodies[size].write_bytes(chat_body(size))
        runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for size in SIZES:
                for store in ("memory", "redis"):
                    for name, tree in trees.items():
                        common = ["--store", store, "--body", str(bodies[size])]
                        common += ["--redis-url", args.redis_url]
                        evict = ["--evict-mb", str(args.evict_mb)] if args.evict_mb else []
                        seq = _run_child(tree, [*common, *evict, "--n", str(args.n)])
                        conc = _run_child(
                            tree, [*common, "--n", str(args.n), "--concurrency", str(CONCURRENT)]
                        )
                        seq["cpu16_us"] = conc["cpu_us"]
                        seq["degraded"] += conc["degraded"]
                        runs.setdefault((name, store, size), []).append(seq)
        for k, results in runs.items():
            rows[k] = {field: statistics.median(r[field] for r in results) for field in results[0]}
        if args.callgrind:
            for size in SIZES:
                for store in ("memory", "redis"):
                    for name, tree in trees.items():
                        common = ["--store", store, "--body", str(bodies[size])]
                        common += ["--redis-url", args.redis_url]
                        rows[(name, store, size)]["ir"] = _instructions(
                            tree, common, args.callgrind_n
                        )
    lines = _table(rows, trees, args)
    print("\n".join(lines))
    out_path.write_text("\n".join(lines) + "\n")


def _table(
    rows: dict[tuple[str, str, int], dict[str, float]],
    trees: dict[str, Path],
    args: argparse.Namespace,
) -> list[str]:
    cg = "ir" in next(iter(rows.values()))
    cold = "p50_cold_us" in next(iter(rows.values()))
    head = "| checkout | state | body | p50 us | p99 us | CPU us/req | CPU us/req, 16 concurrent |"
    head += f" p50 us, {args.evict_mb} MB written between |" if cold else ""
    head += " instructions/req |" if cg else ""
    lines = [
        "# What one routing decision costs ext_proc",
        "",
        f"`python bench/scripts/decision_cost.py {' '.join(sys.argv[1:])}`",
        "",
        f"{args.n} requests per run (after {WARMUP} to warm up), median of {args.rounds} "
        "rounds; 8 instances; Redis on "
        f"{args.redis_url}; bodies share their system prompt, their user message differs.",
        "",
        head,
        "|---|---|---|---|---|---|---|" + ("---|" * (cg + cold)),
    ]
    for (name, store, size), r in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        line = (
            f"| {name} | {store} | {size // 1024} KB | {r['p50_us']:.0f} | {r['p99_us']:.0f} "
            f"| {r['cpu_us']:.0f} | {r['cpu16_us']:.0f} |"
        )
        line += f" {r['p50_cold_us']:.0f} |" if cold else ""
        line += f" {r['ir'] / 1000:.0f}K |" if cg else ""
        lines.append(line + (f" ({r['degraded']:.0f} degraded)" if r["degraded"] else ""))
    for name in (n for n in trees if "old" in trees and n != "old"):
        lines += ["", f"{name} / old:", ""]
        for size in SIZES:
            for store in ("memory", "redis"):
                old, new = rows[("old", store, size)], rows[(name, store, size)]
                text = (
                    f"- {store}, {size // 1024} KB: p50 {new['p50_us'] - old['p50_us']:+.0f} us,"
                    f" CPU {new['cpu_us'] / old['cpu_us']:.2f}x"
                    f" (16 concurrent {new['cpu16_us'] / old['cpu16_us']:.2f}x)"
                )
                if cg:
                    text += f", instructions {new['ir'] / old['ir']:.2f}x"
                lines.append(text)
    return lines


if __name__ == "__main__":
    main()
