"""The control plane's HTTP ports give every request's head a deadline
(control_plane/http_server.py), over real sockets: uvicorn on 127.0.0.1 with the config
the control plane uses, serving a tiny app."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

from control_plane.http_server import HeadTimeoutH11Protocol, server_config
from prefix_router.ops.procs import free_port
from tests.support.uvicorn_server import uvicorn_serving

HEAD_TIMEOUT_S = 0.5


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]}
    )
    await send({"type": "http.response.body", "body": b"hello"})


class ShortDeadline(HeadTimeoutH11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S


@contextlib.asynccontextmanager
async def serving(keep_alive_s: float = 5.0) -> AsyncIterator[int]:
    port = free_port()
    config = server_config(hello, "127.0.0.1", port)
    config.http = ShortDeadline
    config.timeout_keep_alive = keep_alive_s
    async with uvicorn_serving(config):
        yield port


async def closed_after(reader: asyncio.StreamReader, limit_s: float = 5.0) -> float:
    """Seconds until the server closes the connection (what it sends is dropped)."""
    started = time.monotonic()
    async with asyncio.timeout(limit_s):
        while await reader.read(4096):
            pass
    return time.monotonic() - started


async def test_a_connection_that_sends_nothing_is_closed_at_the_deadline() -> None:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            took = await closed_after(reader)
        finally:
            writer.close()
    assert HEAD_TIMEOUT_S * 0.8 < took < HEAD_TIMEOUT_S + 1.0, took


async def test_a_head_sent_a_byte_at_a_time_is_closed_at_the_deadline() -> None:
    head = b"GET / HTTP/1.1\r\nhost: admin\r\nx-padding: " + b"a" * 200
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        try:
            with contextlib.suppress(ConnectionError):
                for byte in head:  # each byte well within the deadline, the head never ends
                    writer.write(bytes([byte]))
                    await writer.drain()
                    if reader.at_eof() or time.monotonic() - started > 5:
                        break
                    await asyncio.sleep(0.02)
            await closed_after(reader)
            took = time.monotonic() - started
        finally:
            writer.close()
    assert HEAD_TIMEOUT_S * 0.8 < took < HEAD_TIMEOUT_S + 1.0, took


async def test_requests_within_the_deadline_are_served_on_one_connection() -> None:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):
                writer.write(b"GET / HTTP/1.1\r\nhost: admin\r\n\r\n")
                await writer.drain()
                async with asyncio.timeout(5):
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    assert await reader.readexactly(5) == b"hello"
                await asyncio.sleep(HEAD_TIMEOUT_S * 0.6)  # each head within its own deadline
        finally:
            writer.close()


async def test_the_next_head_is_due_within_the_keep_alive_timeout() -> None:
    async with serving(keep_alive_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nhost: admin\r\n\r\n")
            async with asyncio.timeout(5):
                await reader.readuntil(b"hello")
            writer.write(b"GET / HTT")  # a head begun, never finished
            took = await closed_after(reader)
        finally:
            writer.close()
    assert 0.3 < took < 1.5, took
