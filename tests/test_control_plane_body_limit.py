"""The admin API bounds what one request makes it read, over real HTTP (uvicorn on
127.0.0.1): a body over the limit is refused before it is read, declared or chunked, and a
body sent too slowly is cut off, all before the bearer token is even looked at."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterable

import pytest

from control_plane.admin import create_app
from control_plane.body_limit import MAX_BODY_BYTES, BodyLimit
from control_plane.http_server import server_config
from control_plane.service import AdminService
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.ops.procs import free_port
from tests.support.redis_ns import fresh_store
from tests.support.uvicorn_server import uvicorn_serving

TOKEN = "s3cret"
WAIT_S = 3.0


@contextlib.asynccontextmanager
async def serving(read_timeout_s: float | None = None) -> AsyncIterator[int]:
    """The admin API on a free port of 127.0.0.1 (its real middleware stack)."""
    async with fresh_store() as store:
        await store.seed(Fleet.of([Instance("127.0.0.1", 9001)]), RouterConfig())
        app = create_app(AdminService(store, store), token=TOKEN)
        if read_timeout_s is not None:  # the same middleware with a short read timeout
            for middleware in app.user_middleware:
                if middleware.cls is BodyLimit:
                    middleware.kwargs["read_timeout_s"] = read_timeout_s
        port = free_port()
        async with uvicorn_serving(server_config(app, "127.0.0.1", port)):
            yield port


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers, body (by its Content-Length)."""
    async with asyncio.timeout(WAIT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        headers = {k.lower(): v for k, v in headers.items()}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def parsed(data: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """The HTTP/1.1 response in data (status, headers, body), or None while incomplete."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if line)}
    length = int(headers.get("content-length", "0"))
    return (int(lines[0].split()[1]), headers, rest[:length]) if len(rest) >= length else None


async def answer_while_sending(
    port: int, head: str, body: Iterable[bytes]
) -> tuple[int, dict[str, str], bytes]:
    """The answer to a request whose body may be refused part way, read while it is sent.

    The server may answer and close before the body is all sent: the send then fails, as
    it should, and the answer the kernel already holds is still read. (An asyncio stream
    would raise the send's error before returning the data it had buffered.)"""
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setblocking(False)

        async def send() -> None:
            with contextlib.suppress(ConnectionError):
                await loop.sock_sendall(sock, head.encode())
                for chunk in body:
                    await loop.sock_sendall(sock, chunk)

        sending = asyncio.create_task(send())
        try:
            data = b""
            async with asyncio.timeout(WAIT_S):
                while (response := parsed(data)) is None:
                    more = await loop.sock_recv(sock, 65536)
                    assert more, f"closed before a whole answer: {data!r}"
                    data += more
            return response
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending


async def request_head(port: int, head: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode())
    await writer.drain()
    return reader, writer


async def test_a_declared_body_over_the_limit_is_refused_before_it_is_read() -> None:
    async with serving() as port:
        status, headers, body = await answer_while_sending(
            port,
            "PUT /config HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
            f"content-length: {100 * MAX_BODY_BYTES}\r\n\r\n",
            [b"{" + b" " * 65536],  # of 100 MiB: the answer comes without the rest
        )
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["detail"] == f"request body over {MAX_BODY_BYTES} bytes"


async def test_a_chunked_body_is_refused_once_it_passes_the_limit() -> None:
    chunk = b"x" * 65536
    chunks = MAX_BODY_BYTES // len(chunk) + 2  # past the limit by more than a chunk
    async with serving() as port:
        status, _, body = await answer_while_sending(
            port,
            "PUT /config HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {TOKEN}\r\ntransfer-encoding: chunked\r\n\r\n",
            (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(chunks)),
        )
        assert status == 413 and b"over" in body


async def test_a_body_sent_too_slowly_is_cut_off() -> None:
    async with serving(read_timeout_s=0.3) as port:
        reader, writer = await request_head(
            port,
            "POST /instances HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
            "content-length: 100\r\n\r\n{",
        )
        try:
            status, _, body = await answer(reader)  # 99 bytes never come
            assert status == 408 and b"too slowly" in body
        finally:
            writer.close()


@pytest.mark.parametrize(
    ("length", "status"), [("12abc", 400), (str(MAX_BODY_BYTES + 1), 413), ("2", 401)]
)
async def test_the_declared_length_is_checked_before_the_token(length: str, status: int) -> None:
    async with serving() as port:
        reader, writer = await request_head(
            port,
            "PATCH /config HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n{{}}",
        )
        try:
            assert (await answer(reader))[0] == status
        finally:
            writer.close()


async def test_a_body_within_the_limit_still_changes_the_config() -> None:
    async with serving() as port:
        patch = json.dumps({"concurrency_threshold": 24}).encode()
        reader, writer = await request_head(
            port,
            "PATCH /config HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {TOKEN}\r\ncontent-length: {len(patch)}\r\n\r\n",
        )
        try:
            writer.write(patch)
            status, _, body = await answer(reader)
            assert status == 200, body
            assert json.loads(body)["config"]["concurrency_threshold"] == 24
        finally:
            writer.close()
