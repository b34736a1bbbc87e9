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
            rows.append(f"| {variant} | {i * streams:,} | {grown:+.2f} | "
                        f"{grown * 2**20 / (i * streams):.1f} | {time.monotonic() - started:.0f} |")
            print(rows[-1], flush=True)
        return rows
    finally:
        server.kill()
        server.wait()


def through_envoy(rounds: int, seconds: int, preload: str | None = None) -> None:
    started: list[ManagedProcess] = []
    logs = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    try:
        ports = [free_port() for _ in range(3)]
        started.append(start_module("backends", "tests.support.echo_backend",
                                    [str(p) for p in ports], logs, ready_ports=ports))
        ep_port = free_port()
        ext_proc = start_ext_proc(
            ep_port, logs, args=[a for p in ports for a in ("--backend", f"127.0.0.1:{p}")],
            env={"LD_PRELOAD": preload} if preload else None,
        )
        started.append(ext_proc)
        params = BootstrapParams(listen_port=free_port(), admin_port=free_port(),
                                 ext_proc=(("127.0.0.1", ep_port),))
        fleet = Fleet.of([Instance("127.0.0.1", p) for p in ports])
        started.append(start_envoy(params, RouterConfig(), logs, fleet=fleet, concurrency=2))
        url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
        rss = psutil.Process(ext_proc.pid).memory_info
        print("| round | requests | ext_proc RSS MB | non-2xx |")
        print("|---|---|---|---|")
        print(f"| 0 | 0 | {rss().rss / 2**20:.2f} | 0 |", flush=True)
        total = 0
        for i in range(1, rounds + 1):
            result = run_wrk(url, chat_body(1024), connections=16, threads=2, seconds=seconds)
            total += int(result["rps"] * seconds)
            print(f"| {i} | {total:,} | {rss().rss / 2**20:.2f} | {int(result['errors'])} |",
                  flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("envoy", "grpc"))
    parser.add_argument("--rounds", type=int, help="rounds (envoy: 24, grpc: 4)")
    parser.add_argument("--seconds", type=int, default=30, help="envoy: seconds per round")
    parser.add_argument("--variants", default="sleep,return,clean", help="grpc: stream ends")
    parser.add_argument("--streams", type=int, default=25_000, help="grpc: streams per round")
    parser.add_argument("--preload", help="envoy: LD_PRELOAD for ext_proc (an allocator)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.port))
    elif args.part == "envoy":
        through_envoy(args.rounds or 24, args.seconds, args.preload)
    else:
        print("| stream end | streams after warm-up | server RSS growth MB | bytes per stream "
              "| s |")
        print("|---|---|---|---|---|")
        for variant in args.variants.split(","):
            measure(variant, args.streams, args.rounds or 4)


if __name__ == "__main__":
    main()
