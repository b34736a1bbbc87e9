"""The xDS port's limits on every peer (control_plane/xds_limits.py), over real sockets.

Each test builds the control plane's gRPC server with :func:`xds_grpc_server` and small
limits, and checks what a peer past each limit sees.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from control_plane.server import _parser, main
from control_plane.xds_limits import XdsLimits, xds_grpc_server
from prefix_router.ops.procs import free_port

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3


def test_limits_become_grpc_channel_arguments() -> None:
    options = dict(
        XdsLimits(
            max_connections=7,
            max_streams_per_connection=3,
            handshake_timeout_s=1.5,
            idle_timeout_s=60,
        ).server_options()
    )
    assert options == {
        "grpc.so_reuseport": 0,
        "grpc.server_handshake_timeout_ms": 1500,
        "grpc.max_allowed_incoming_connections": 7,
        "grpc.max_connection_idle_ms": 60_000,
        "grpc.max_concurrent_streams": 3,
        "grpc.http2.min_ping_interval_without_data_ms": 10_000,  # Envoy's keepalive: 15 s
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_connections", 0),
        ("max_streams_per_connection", -1),
        ("max_calls", 0),
        ("handshake_timeout_s", 0.0),
        ("idle_timeout_s", -5.0),
    ],
)
def test_a_limit_that_would_refuse_everything_is_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        XdsLimits(**{field: value})  # type: ignore[arg-type]


def test_the_command_line_sets_each_limit() -> None:
    args = _parser().parse_args(
        [
            "--xds-max-connections=9",
            "--xds-max-streams=2",
            "--xds-max-calls=5",
            "--xds-handshake-timeout=3",
            "--xds-idle-timeout=30",
        ]
    )
    assert (
        args.xds_max_connections,
        args.xds_max_streams,
        args.xds_max_calls,
        args.xds_handshake_timeout,
        args.xds_idle_timeout,
    ) == (9, 2, 5, 3.0, 30.0)
    defaults = _parser().parse_args([])
    assert defaults.xds_max_connections == XdsLimits().max_connections


LIMITS = XdsLimits(
    max_connections=3, max_streams_per_connection=5, max_calls=4, handshake_timeout_s=1.0
)


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = xds_grpc_server(LIMITS)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    chosen = free_port()
    server.add_insecure_port(f"127.0.0.1:{chosen}")
    await server.start()
    try:
        yield chosen
    finally:
        await server.stop(grace=None)


def _connect(port: int, *, handshake: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if handshake:
        s.sendall(PREFACE + EMPTY_SETTINGS)
    return s


def _read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server writes until it closes the connection, and when it closed."""
    started = time.monotonic()
    data = b""
    s.settimeout(limit_s)
    while True:
        try:
            chunk = s.recv(4096)
        except (TimeoutError, ConnectionResetError):
            return data, -1.0
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    while pos + 9 <= len(data):
        size = int.from_bytes(data[pos : pos + 3], "big")
        out.append((data[pos + 3], data[pos + 9 : pos + 9 + size]))
        pos += 9 + size
    return out


async def test_a_connection_that_never_finishes_the_handshake_is_closed(port: int) -> None:
    silent = _connect(port, handshake=False)
    try:
        data, closed_after = await asyncio.to_thread(_read_until_closed, silent, 5.0)
    finally:
        silent.close()
    # closed within the read's 5 s (gRPC's default would wait 120 s), not before its 1 s
    assert closed_after > 0.5, closed_after
    assert any(kind == 0x7 for kind, _ in _frames(data)), "no GOAWAY before the close"


async def test_the_stream_limit_is_advertised(port: int) -> None:
    s = _connect(port)
    try:
        s.settimeout(5)
        first = s.recv(4096)
    finally:
        s.close()
    kind, payload = _frames(first)[0]
    assert kind == 0x4  # the server's SETTINGS
    settings = dict(struct.unpack(">HI", payload[i : i + 6]) for i in range(0, len(payload), 6))
    assert settings[SETTINGS_MAX_CONCURRENT_STREAMS] == 5


async def test_connections_past_the_cap_are_closed_at_once(port: int) -> None:
    held = [_connect(port) for _ in range(3)]
    try:
        for s in held:
            s.settimeout(5)
            assert s.recv(4096)  # each of the first three gets the server's SETTINGS
        extra = _connect(port)
        try:
            data, closed_after = await asyncio.to_thread(_read_until_closed, extra, 5.0)
        finally:
            extra.close()
        assert data == b"" and closed_after >= 0, (data, closed_after)  # closed, unanswered
    finally:
        for s in held:
            s.close()
    # once the server sees them gone, a new connection is served again
    deadline = time.monotonic() + 10
    while True:
        again = _connect(port)
        try:
            again.settimeout(5)
            if again.recv(4096):
                break
        except ConnectionResetError:
            pass
        finally:
            again.close()
        assert time.monotonic() < deadline, "no connection served after the others closed"
        await asyncio.sleep(0.1)


async def test_calls_past_the_process_limit_are_refused(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(6)]
        outcomes = []
        for call in calls:
            try:
                await asyncio.wait_for(call.read(), 5)
                outcomes.append("served")
            except grpc.aio.AioRpcError as exc:
                outcomes.append(exc.code().name)
        for call in calls:
            call.cancel()
    # the calls reach the server in any order: any four of them are served
    assert sorted(outcomes) == ["RESOURCE_EXHAUSTED"] * 2 + ["served"] * 4, outcomes


def test_a_bad_limit_flag_is_a_one_line_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--xds-max-streams", "0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "prefix-router control-plane: error: argument --xds-max-streams: must be at least 1, got 0"
    )
