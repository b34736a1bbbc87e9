"""The admin API bounds what one request makes it read, over real HTTP (uvicorn on
127.0.0.1): a body over the limit is refused before it is read, declared or chunked, and a
body sent too slowly is cut off, all before the bearer token is even looked at."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

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


async def request_head(port: int, head: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode())
    await writer.drain()
    return reader, writer


async def test_a_declared_body_over_the_limit_is_refused_before_it_is_read() -> None:
    async with serving() as port:
        reader, writer = await request_head(
            port,
            "PUT /config HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
            f"content-length: {100 * MAX_BODY_BYTES}\r\n\r\n",
        )
        try:
            writer.write(b"{" + b" " * 65536)  # of 100 MiB: the answer comes without the rest
            status, headers, body = await answer(reader)
            assert status == 413 and headers["connection"] == "close"
            assert json.loads(body)["detail"] == f"request body over {MAX_BODY_BYTES} bytes"
        finally:
            writer.close()


async def test_a_chunked_body_is_refused_once_it_passes_the_limit() -> None:
    chunk = b"x" * 65536
    async with serving() as port:
        reader, writer = await request_head(
            port,
            "PUT /config HTTP/1.1\r\nhost: admin\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {TOKEN}\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        try:
            sent = 0
            with contextlib.suppress(ConnectionError):  # refused: the server may close first
                while sent <= MAX_BODY_BYTES + len(chunk):
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    sent += len(chunk)
            status, _, body = await answer(reader)
            assert status == 413 and b"over" in body
        finally:
            writer.close()


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
