"""ext_proc's memory per request, and a bare grpc.aio server's per stream, to tell them apart.

``envoy``: the real ext_proc (in-process counts) behind one Envoy and three echo backends,
driven by wrk (16 connections, 1 KB chat bodies) in rounds; ext_proc's RSS after each.

``grpc``: a bare grpc.aio server with one generic stream-stream method that answers three
messages per stream (as ext_proc answers request headers, body, response headers), then

* ``sleep``: waits until the client cancels (what ext_proc did while Envoy reset every
  stream);
* ``return``: ends the stream itself, while the client cancels;
* ``clean``: ends the stream itself; the client half-closes and reads the status (near
  ext_proc's shape now: Envoy half-closes first, then ext_proc ends the stream).

Its client (this process) runs 16 streams at a time over one channel. Loopback only,
bounded in rounds; every process started is stopped.

    python bench/scripts/ext_proc_memory.py envoy [--rounds 24 --seconds 30] [--preload LIB]
        [--ends graceful,reset] [--transport http2|grpcio]

``--ends graceful,reset`` runs two stacks, one with Envoy's graceful close (our bootstrap)
and one with it off (Envoy resets every ext_proc stream at the request's end), their
rounds alternating.

``--preload /usr/lib/x86_64-linux-gnu/libjemalloc.so.2`` runs ext_proc (only) on another
allocator, to tell an allocator's fragmentation from a leak.
    python bench/scripts/ext_proc_memory.py grpc [--variants sleep,return,clean --streams 25000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psutil

from bench.scripts._harness import chat_body, run_wrk
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import start_envoy, start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port

METHOD = "/bench.Streams/Process"


async def serve(variant: str, port: int) -> None:
    async def process(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        answered = 0
        async for _ in requests:
            answered += 1
            yield b"ok"
            if answered == 3:
                if variant == "sleep":
                    await asyncio.sleep(3600)  # until the client's cancel ends it
                return

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "bench.Streams", {"Process": grpc.stream_stream_rpc_method_handler(process)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def drive(port: int, variant: str, streams: int, concurrency: int = 16) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.stream_stream(METHOD)

        async def one() -> None:
            call = method()
            for _ in range(3):
                await call.write(b"x" * 200)
                await call.read()
            if variant == "clean":
                await call.done_writing()
                await call.code()
            else:
                call.cancel()

        for _ in range(0, streams, concurrency):
            await asyncio.gather(*(one() for _ in range(concurrency)))


def measure(variant: str, streams: int, rounds: int) -> list[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "grpc", "--serve", variant, "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        rss = psutil.Process(server.pid).memory_info
        asyncio.run(drive(port, variant, 5000))  # warm-up
        base, started, rows = rss().rss, time.monotonic(), []
        for i in range(1, rounds + 1):
            asyncio.run(drive(port, variant, streams))
            grown = (rss().rss - base) / 2**20
            rows.append(
                f"| {variant} | {i * streams:,} | {grown:+.2f} | "
                f"{grown * 2**20 / (i * streams):.1f} | {time.monotonic() - started:.0f} |"
            )
            print(rows[-1], flush=True)
        return rows
    finally:
        server.kill()
        server.wait()


def _start_behind_envoy(
    logs: Path, *, graceful: bool, transport: str, preload: str | None
) -> tuple[list[ManagedProcess], str, int, int, int]:
    """Echo backends, one ext_proc and one Envoy; returns the processes, the data-plane
    URL, ext_proc's PID, its metrics port and Envoy's admin port."""
    started: list[ManagedProcess] = []
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
        ep_port, metrics_port = free_port(), free_port()
        ext_proc = start_ext_proc(
            ep_port,
            logs,
            args=[
                *(a for p in ports for a in ("--backend", f"127.0.0.1:{p}")),
                "--transport",
                transport,
                "--metrics-port",
                str(metrics_port),
            ],
            env={"LD_PRELOAD": preload} if preload else None,
        )
        started.append(ext_proc)
        params = BootstrapParams(
            listen_port=free_port(),
            admin_port=free_port(),
            ext_proc=(("127.0.0.1", ep_port),),
            graceful_close=graceful,
        )
        fleet = Fleet.of([Instance("127.0.0.1", p) for p in ports])
        started.append(start_envoy(params, RouterConfig(), logs, fleet=fleet, concurrency=2))
    except BaseException:
        for proc in reversed(started):
            proc.stop()
        raise
    url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
    return started, url, ext_proc.pid, metrics_port, params.admin_port


def _stream_ends(metrics_port: int, admin_port: int) -> str:
    """How ext_proc saw its streams end, and how many Envoy reset: proof of the mode."""
    ends = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("prefix_router_ext_proc_stream_ends_total{"):
                how = line.split('how="', 1)[1].split('"', 1)[0]
                ends[how] = int(float(line.rsplit(" ", 1)[1]))
    with urllib.request.urlopen(
        f"http://127.0.0.1:{admin_port}/stats?filter=^cluster.ext_proc.upstream_rq_tx_reset$",
        timeout=5,
    ) as r:
        resets = r.read().decode().strip().rsplit(" ", 1)[-1]
    return f"ext_proc saw {ends}; Envoy reset {resets} ext_proc streams"


def through_envoy(
    rounds: int,
    seconds: int,
    preload: str | None = None,
    *,
    ends: tuple[str, ...] = ("graceful",),
    transport: str = "http2",
) -> None:
    """ext_proc's RSS per round behind Envoy, one stack per way of ending streams
    (``graceful``: half-close; ``reset``: the runtime flag off). With two, their rounds
    alternate, so both see the same machine."""
    stacks: dict[str, tuple[list[ManagedProcess], str, int, int, int]] = {}
    try:
        for end in ends:
            logs = Path(tempfile.mkdtemp(prefix=f"bench-memory-{end}-"))
            stacks[end] = _start_behind_envoy(
                logs, graceful=end == "graceful", transport=transport, preload=preload
            )
        rss = {end: psutil.Process(stack[2]).memory_info for end, stack in stacks.items()}
        print(f"transport {transport}")
        print("| streams end by | round | requests | ext_proc RSS MB | non-2xx |")
        print("|---|---|---|---|---|")
        total = dict.fromkeys(ends, 0)
        for end in ends:
            print(f"| {end} | 0 | 0 | {rss[end]().rss / 2**20:.2f} | 0 |", flush=True)
        for i in range(1, rounds + 1):
            for end in ends:
                result = run_wrk(
                    stacks[end][1], chat_body(1024), connections=16, threads=2, seconds=seconds
                )
                total[end] += int(result["rps"] * seconds)
                print(
                    f"| {end} | {i} | {total[end]:,} | {rss[end]().rss / 2**20:.2f} | "
                    f"{int(result['errors'])} |",
                    flush=True,
                )
        for end, stack in stacks.items():
            print(f"{end}: {_stream_ends(stack[3], stack[4])}")
    finally:
        for stack in stacks.values():
            for proc in reversed(stack[0]):
                proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=("envoy", "grpc"))
    parser.add_argument("--rounds", type=int, help="rounds (envoy: 24, grpc: 4)")
    parser.add_argument("--seconds", type=int, default=30, help="envoy: seconds per round")
    parser.add_argument("--variants", default="sleep,return,clean", help="grpc: stream ends")
    parser.add_argument("--streams", type=int, default=25_000, help="grpc: streams per round")
    parser.add_argument("--preload", help="envoy: LD_PRELOAD for ext_proc (an allocator)")
    parser.add_argument(
        "--ends",
        default="graceful",
        help="envoy: how Envoy ends ext_proc streams, comma-separated: "
        "graceful (half-close, our bootstrap) and/or reset (flag off)",
    )
    parser.add_argument(
        "--transport",
        default="http2",
        choices=("http2", "grpcio"),
        help="envoy: ext_proc's gRPC server",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.port))
    elif args.part == "envoy":
        through_envoy(
            args.rounds or 24,
            args.seconds,
            args.preload,
            ends=tuple(args.ends.split(",")),
            transport=args.transport,
        )
    else:
        print(
            "| stream end | streams after warm-up | server RSS growth MB | bytes per stream | s |"
        )
        print("|---|---|---|---|---|")
        for variant in args.variants.split(","):
            measure(variant, args.streams, args.rounds or 4)


if __name__ == "__main__":
    main()
