"""Long responses for minutes: a heavy tail of streamed generations, client aborts, lulls.

Issue 19: a streamed response that ended more than 50 s after its Envoy worker last started
an ext_proc stream crashed Envoy 1.40, and with it the stack. This drives the whole local
stack (``prefix-router up``'s: Redis, simulated vLLM at real time, control plane, two
ext_proc workers, Envoy) with streamed chat completions whose lengths follow a heavy tail:
most are short, some take 2 to 10 minutes of streaming (20 ms a token). A share of the
clients abort mid-stream. Twice the arrivals pause for longer than Envoy's default cached
client idle time (50 s) while long streams are open, and at the end the arrivals stop and
every stream runs out: the conditions of the crash.

It reports failed requests (anything but a complete stream or our own abort), whether
every component is alive at the end with the PID it started with (a restarted process
would hide a crash), the in-flight counts in each ext_proc and in Redis once every stream
is done, and each component's RSS every minute. Bounded: arrivals stop after
``--minutes``, at most ``--max-open`` streams at once (arrivals past it are skipped and
counted), every stream is read to its end or aborted. Loopback only. Not part of the
test run.

    flock /tmp/prefix-router-heavy.lock python bench/scripts/long_response_soak.py --minutes 20
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import random
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
import redis

from bench.scripts._harness import ROOT, rss_table
from prefix_router.ops.procs import free_port
from prefix_router.ops.up import Stack, resolve_settings

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
TOKEN_S = 0.02
"""About one decode step of the simulated 70B model at time scale 1 (more when busy)."""


@dataclass(frozen=True)
class Shape:
    """One request: how many tokens, and after how many seconds the client gives up."""

    kind: str
    tokens: int
    abort_after_s: float | None


def draw(rng: random.Random, abort_share: float, time_scale: float = 1.0) -> Shape:
    """The heavy tail: 80% short (16-300 tokens, under 6 s), 14% medium (300-3,000, up to a
    minute), 6% long (6,000-30,000 tokens log-uniform: 2 to 10 minutes of streaming)."""
    u = rng.random()
    if u < 0.80:
        kind, tokens = "short", rng.randint(16, 300)
    elif u < 0.94:
        kind, tokens = "medium", rng.randint(300, 3_000)
    else:
        kind, tokens = "long", int(math.exp(rng.uniform(math.log(6_000), math.log(30_000))))
    abort = None
    if rng.random() < abort_share:
        abort = rng.uniform(0.1, 0.9) * tokens * TOKEN_S / time_scale
    return Shape(kind, tokens, abort)


def body(shape: Shape, serial: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": shape.tokens,
            "ignore_eos": True,
            "messages": [
                {"role": "system", "content": f"System prompt {serial % 8}. " * 40},
                {"role": "user", "content": f"request {serial}"},
            ],
        }
    ).encode()


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    aborted: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    skipped: int = 0
    longest_s: float = 0.0


async def one(port: int, shape: Shape, serial: int, tally: Tally, time_scale: float) -> None:
    """POST and read the SSE stream to its end (or abort it); classify the outcome.

    Raw asyncio streams, not httpx: on two shared cores a heavier client would measure
    itself. Only the status, the chunked framing and the last bytes are looked at. A stream
    that takes three times its expected length plus two minutes counts as failed (stalled),
    so the run stays bounded."""
    tally.sent[shape.kind] += 1
    started = time.monotonic()
    give_up_at = started + 3 * shape.tokens * TOKEN_S / time_scale + 120
    abort_at = None if shape.abort_after_s is None else started + shape.abort_after_s
    until = min(give_up_at, abort_at or give_up_at)
    payload = body(shape, serial)
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), until - time.monotonic())
        status = int(head[9:12])
        if status != 200:
            raise ValueError(f"HTTP {status}")
        tail = b""
        while True:
            line = await asyncio.wait_for(reader.readuntil(b"\r\n"), until - time.monotonic())
            size = int(line[:-2], 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), until - time.monotonic())
            if size == 0:
                break
            tail = (tail + data[:-2])[-4096:]
        if b"data: [DONE]" not in tail:
            raise ValueError("stream ended without [DONE]")
        events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {") and b'"usage"' in e]
        if not events:
            raise ValueError("stream ended without usage")
        usage = json.loads(events[-1][len(b"data: ") :])["usage"]
        if usage["completion_tokens"] != shape.tokens:
            raise ValueError(f"{usage['completion_tokens']} of {shape.tokens} tokens")
        tally.completed[shape.kind] += 1
        tally.longest_s = max(tally.longest_s, time.monotonic() - started)
    except TimeoutError:
        if abort_at is not None and abort_at <= give_up_at:
            tally.aborted[shape.kind] += 1  # closing the connection below is the abort
        else:
            _failed(tally, shape, started, "stalled: no end in time")
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        _failed(tally, shape, started, f"{type(exc).__name__}: {exc}")
    finally:
        if writer is not None:
            writer.close()


def _failed(tally: Tally, shape: Shape, started: float, why: str) -> None:
    tally.failed[shape.kind] += 1
    tally.failures.append(
        f"{shape.kind} {shape.tokens} tokens after {time.monotonic() - started:.1f} s: {why}"
    )


def lull_windows(minutes: float, lull_s: float) -> list[tuple[float, float]]:
    """Two pauses in the arrivals, at a third and two thirds of the run."""
    total = minutes * 60
    return [(total * f, total * f + lull_s) for f in (1 / 3, 2 / 3)]


async def drive(
    port: int,
    *,
    minutes: float,
    rate: float,
    abort_share: float,
    max_open: int,
    lull_s: float,
    time_scale: float,
) -> Tally:
    rng = random.Random(19)
    tally = Tally()
    pending: set[asyncio.Task[None]] = set()
    lulls = lull_windows(minutes, lull_s)
    started = time.monotonic()
    deadline = started + minutes * 60
    next_at, serial = started, 0
    while next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        at = next_at - started
        next_at += rng.expovariate(rate)
        if any(a <= at < b for a, b in lulls):
            continue
        shape = draw(rng, abort_share, time_scale)
        if len(pending) >= max_open:
            tally.skipped += 1
            continue
        serial += 1
        task = asyncio.create_task(one(port, shape, serial, tally, time_scale))
        pending.add(task)
        task.add_done_callback(pending.discard)
    print(
        f"arrivals stopped after {serial} requests; {len(pending)} streams still open", flush=True
    )
    await asyncio.gather(*pending)
    return tally


def rss_mb(stack: Stack) -> dict[str, float]:
    out = {}
    for proc in stack.procs:
        try:
            out[proc.name] = psutil.Process(proc.pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            out[proc.name] = float("nan")
    return out


def ext_proc_in_flight(urls: list[str]) -> list[float]:
    totals = []
    for url in urls:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        totals.append(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("prefix_router_ext_proc_in_flight")
            )
        )
    return totals


def redis_in_flight(stack: Stack) -> int:
    assert stack.redis_url is not None
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    try:
        raw = client.hgetall(f"{stack.settings.namespace}inflight")
    finally:
        client.close()
    return sum(int(v) for v in raw.values())


def settled_in_flight(stack: Stack, timeout_s: float = 30.0) -> tuple[list[float], int, float]:
    """The counts once they reach 0 (or after ``timeout_s``), and how long that took."""
    started = time.monotonic()
    while True:
        local, shared = ext_proc_in_flight(stack.ext_proc_metrics), redis_in_flight(stack)
        waited = time.monotonic() - started
        if (not any(local) and shared == 0) or waited > timeout_s:
            return local, shared, waited
        time.sleep(0.2)


def crash_conditions(access_log: Path, idle_s: float = 50.0) -> tuple[int, int]:
    """From Envoy's access log: requests, and how many ended more than ``idle_s`` after the
    last request start anywhere, so after their worker's last too. With Envoy's default
    cached-client idle time (50 s) each of those would crash Envoy 1.36-1.40 (issue 19)."""
    starts, ends = [], []
    for line in access_log.read_text(errors="replace").splitlines():
        if not line.startswith('{"bytes_in"'):
            continue
        row = json.loads(line)
        start = datetime.fromisoformat(row["time"].replace("Z", "+00:00")).timestamp()
        starts.append(start)
        ends.append(start + row["duration_ms"] / 1000)
    starts.sort()
    late = sum(1 for end in ends if end - starts[bisect.bisect_right(starts, end) - 1] > idle_s)
    return len(ends), late


def envoy_stats(admin_port: int) -> dict[str, str]:
    names = (
        "cluster.ext_proc.upstream_rq_completed",
        "cluster.ext_proc.upstream_rq_tx_reset",
        "http.data_plane.downstream_rq_completed",
        "server.uptime",
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats", timeout=5) as r:
        lines = r.read().decode().splitlines()
    stats = dict(line.split(": ", 1) for line in lines if ": " in line)
    return {n: stats.get(n, "?") for n in names}


async def sampled(
    stack: Stack, load: asyncio.Task[Tally], every: float
) -> list[tuple[float, dict[str, float]]]:
    samples: list[tuple[float, dict[str, float]]] = []
    started = time.monotonic()
    while not load.done():
        samples.append((time.monotonic() - started, rss_mb(stack)))
        await asyncio.wait({load}, timeout=every)
    samples.append((time.monotonic() - started, rss_mb(stack)))
    return samples


async def run(
    stack: Stack, args: argparse.Namespace
) -> tuple[Tally, list[tuple[float, dict[str, float]]]]:
    load = asyncio.create_task(
        drive(
            stack.settings.port,
            minutes=args.minutes,
            rate=args.rate,
            abort_share=args.abort_share,
            max_open=args.max_open,
            lull_s=args.lull_seconds,
            time_scale=args.sim_time_scale,
        )
    )
    samples = await sampled(stack, load, args.sample_seconds)
    return load.result(), samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=20.0, help="arrivals for this long")
    parser.add_argument("--rate", type=float, default=0.6, help="Poisson arrivals per second")
    parser.add_argument(
        "--abort-share", type=float, default=0.1, help="share of clients that abort mid-stream"
    )
    parser.add_argument("--max-open", type=int, default=64, help="streams open at most")
    parser.add_argument(
        "--lull-seconds", type=float, default=75.0, help="each of the two pauses in the arrivals"
    )
    parser.add_argument("--sample-seconds", type=float, default=60.0)
    parser.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        help="simulator speed-up (1: real time; more only for a quick check of the script)",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "long_response_soak.md"
    )
    args = parser.parse_args()

    run_dir = tempfile.mkdtemp(prefix="long-soak-")
    settings, config = resolve_settings(
        [
            "--run-dir", run_dir, "--port", str(free_port()), "--admin-port", str(free_port()),
            "--envoy-admin-port", str(free_port()), "--xds-port", str(free_port()),
            "--instances", "4", "--sim-time-scale", str(args.sim_time_scale), "--ext-procs", "2",
        ]
    )  # fmt: skip
    stack = Stack(settings, config)
    wall = time.monotonic()
    try:
        stack.start()
        pids = {proc.name: proc.pid for proc in stack.procs}
        print(f"stack up ({', '.join(pids)}); logs in {run_dir}", flush=True)
        tally, samples = asyncio.run(run(stack, args))
        alive = {proc.name: proc.alive() and proc.pid == pids[proc.name] for proc in stack.procs}
        local, shared, waited = settled_in_flight(stack)
        envoy = envoy_stats(settings.envoy_admin_port) if alive.get("envoy") else {}
    finally:
        stack.stop()
    wall_min = (time.monotonic() - wall) / 60
    logged, late = crash_conditions(Path(run_dir) / "logs" / "envoy.log")
    names = list(samples[0][1])
    kinds = ("short", "medium", "long")
    lines = [
        f"## Long-response soak: {args.minutes:g} min of arrivals, {wall_min:.1f} min in all",
        "",
        f"Poisson arrivals at {args.rate:g}/s (none during two {args.lull_seconds:g} s lulls, "
        f"at {', '.join(f'{a / 60:.1f}' for a, _ in lull_windows(args.minutes, args.lull_seconds))}"
        f" min), {args.abort_share:.0%} of clients abort mid-stream; 4 simulated "
        f"Llama-3.1-70B instances at time scale {args.sim_time_scale:g}, 2 ext_proc workers, "
        "Redis, control plane, "
        "Envoy (2 workers), all as `prefix-router up` starts them.",
        "",
        "| requests | short | medium | long | all |",
        "|---|---|---|---|---|",
        *[
            f"| {label} | " + " | ".join(str(c[k]) for k in kinds) + f" | {sum(c.values())} |"
            for label, c in (
                ("sent", tally.sent),
                ("completed", tally.completed),
                ("aborted by the client", tally.aborted),
                ("**failed**", tally.failed),
            )
        ],
        "",
        f"- longest completed stream: {tally.longest_s / 60:.1f} min; arrivals skipped at "
        f"{args.max_open} open streams: {tally.skipped}",
        f"- every component alive at the end with its first PID: "
        f"{all(alive.values())} ({', '.join(f'{k}: {v}' for k, v in alive.items())})",
        f"- in flight once every stream was done: ext_proc {local}, Redis {shared} "
        f"(settled in {waited:.1f} s)",
        f"- Envoy: {envoy}",
        f"- of {logged} requests in Envoy's access log, {late} ended more than 50 s after the "
        "last request start anywhere: with Envoy's default cached-client idle time each of "
        "them would have crashed Envoy 1.36-1.40 (issue 19)",
        *(
            ["", "Failures:", "", *[f"- {f}" for f in tally.failures[:20]]]
            if tally.failures
            else []
        ),
        "",
        "RSS (MB):",
        "",
        *rss_table(samples, names),
    ]
    report = "\n".join(lines)
    print(report)
    args.out.write_text(report + "\n")
    Path(run_dir).joinpath("long_response_soak.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
