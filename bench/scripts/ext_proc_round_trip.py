"""Each ext_proc message's round trip, without Envoy: where a tiny request's time goes.

A raw HTTP/2 client (hand-made frames, one connection, concurrency 1) sends what Envoy
sends for a 1 KB chat request (request headers, then the body) and times each answer,
against three servers started here on 127.0.0.1:

* ``ours``: prefix-router ext_proc (static fleet, in-process counts);
* ``floor``: our gRPC server answering every message at once with "continue" (no routing:
  what the transport costs);
* ``bare``: the bare grpcio ext_proc (``bare_ext_proc.py``, no routing).

    python -m bench.scripts.ext_proc_round_trip [--exchanges 3000]

``python -m bench.scripts.ext_proc_round_trip --floor PORT`` serves the floor alone.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import tempfile
import time
from pathlib import Path

import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.scripts._harness import chat_body
from ext_proc.http2.grpc_server import Answer, GrpcServer
from ext_proc.servicer import CONTINUE, PROCESS_PATH
from prefix_router.ops.launch import start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, free_port

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def grpc_message(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def request_block() -> bytes:
    """The call's header block: HPACK literals without indexing."""
    fields = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", PROCESS_PATH.encode()),
        (b":authority", b"ext_proc"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]
    return b"".join(b"\x00" + bytes([len(k)]) + k + bytes([len(v)]) + v for k, v in fields)


def envoy_messages(body_bytes: int = 1024) -> tuple[bytes, bytes]:
    def header(key: str, value: str) -> base_pb2.HeaderValue:
        return base_pb2.HeaderValue(key=key, raw_value=value.encode())

    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                header(":authority", "127.0.0.1"),
                header(":path", "/v1/chat/completions"),
                header(":method", "POST"),
                header("content-type", "application/json"),
                header("x-request-id", "0b1c7c4e-3c33-4b8e-8f3c-1d2e3f4a5b6c"),
            ]
        )
    )
    body = pb.HttpBody(body=chat_body(body_bytes), end_of_stream=True)
    return (
        grpc_message(pb.ProcessingRequest(request_headers=headers).SerializeToString()),
        grpc_message(pb.ProcessingRequest(request_body=body).SerializeToString()),
    )


class Client:
    """Blocking and minimal: enough HTTP/2 to time one call's two answers."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        window = struct.pack(">HL", 4, 2**31 - 1)
        self.sock.sendall(
            PREFACE + frame(4, 0, 0, window) + frame(8, 0, 0, struct.pack(">L", 2**31 - 65_536))
        )
        self.buffer = bytearray()

    def until(self, kind: int, stream_id: int, flags: int = 0) -> None:
        """Read until a frame of ``kind`` (with ``flags``) on ``stream_id``."""
        while True:
            pos = 0
            while pos + 9 <= len(self.buffer):
                length = int.from_bytes(self.buffer[pos : pos + 3], "big")
                if pos + 9 + length > len(self.buffer):
                    break
                k, f = self.buffer[pos + 3], self.buffer[pos + 4]
                sid = int.from_bytes(self.buffer[pos + 5 : pos + 9], "big")
                pos += 9 + length
                if k == 4 and not f & 1:
                    self.sock.sendall(frame(4, 1, 0))  # ACK the server's SETTINGS
                if k == kind and sid == stream_id and f & flags == flags:
                    del self.buffer[:pos]
                    return
            del self.buffer[:pos]
            chunk = self.sock.recv(65_536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buffer += chunk


def round_trips(port: int, exchanges: int, body_bytes: int = 1024) -> tuple[float, float]:
    """Median microseconds of the headers' answer and of the body's (first 10% dropped)."""
    headers, body = envoy_messages(body_bytes)
    block = request_block()
    client = Client(port)
    first, second = [], []
    for i in range(exchanges):
        sid = 2 * i + 1
        started = time.perf_counter()
        client.sock.sendall(frame(1, 0x4, sid, block) + frame(0, 0, sid, headers))
        client.until(0, sid)
        answered = time.perf_counter()
        for start in range(0, len(body), 16_384):  # Envoy's frames: 16 KiB at most
            last = start + 16_384 >= len(body)
            client.sock.sendall(frame(0, 0x1 if last else 0, sid, body[start : start + 16_384]))
        client.until(0, sid)
        first.append(answered - started)
        second.append(time.perf_counter() - answered)
        client.until(1, sid, flags=0x1)  # the trailers
    skip = exchanges // 10
    return statistics.median(first[skip:]) * 1e6, statistics.median(second[skip:]) * 1e6


class _Continue:
    def on_message(self, message: bytes) -> Answer:
        kind = pb.ProcessingRequest.FromString(message).WhichOneof("request")
        return CONTINUE.get(kind or "")

    def on_end(self, cancelled: bool) -> None:
        pass


async def serve_floor(port: int) -> None:
    server = GrpcServer({PROCESS_PATH: _Continue})
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--exchanges", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--floor", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor:
        uvloop.run(serve_floor(args.floor))
        return
    logs = Path(tempfile.mkdtemp(prefix="bench-rtt-"))
    started: list[ManagedProcess] = []
    try:
        ports = {name: free_port() for name in ("ours", "floor", "bare")}
        backends = [a for i in range(3) for a in ("--backend", f"127.0.0.1:{9100 + i}")]
        started.append(start_ext_proc(ports["ours"], logs, args=backends))
        started.append(
            start_module(
                "floor",
                "bench.scripts.ext_proc_round_trip",
                ["--floor", str(ports["floor"])],
                logs,
                ready_ports=[ports["floor"]],
            )
        )
        started.append(
            start_module(
                "bare",
                "bench.scripts.bare_ext_proc",
                [str(ports["bare"])],
                logs,
                ready_ports=[ports["bare"]],
            )
        )
        print("| ext_proc | request-headers answer us | request-body answer us |")
        print("|---|---|---|")
        for _ in range(args.rounds):
            for name, port in ports.items():
                headers_us, body_us = round_trips(port, args.exchanges, args.body_bytes)
                print(f"| {name} | {headers_us:.0f} | {body_us:.0f} |", flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()


if __name__ == "__main__":
    main()
