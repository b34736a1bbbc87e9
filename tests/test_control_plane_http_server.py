"""The control plane's HTTP ports give every request's head a deadline and hold a bounded
number of connections (control_plane/http_server.py), over real sockets: uvicorn on
127.0.0.1 with the config the control plane uses, serving a tiny app."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.http_server import BREACHES, MAX_CONNECTIONS, server_config
from control_plane.server import _parser
from prefix_router.ops.procs import free_port
from tests.support.uvicorn_server import uvicorn_serving

HEAD_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]}
    )
    await send({"type": "http.response.body", "body": b"hello"})


@contextlib.asynccontextmanager
async def serving(
    keep_alive_s: float = 5.0,
    *,
    app: ASGIApp = hello,
    name: str = "test",
    max_connections: int = 64,
    head_timeout_s: float = HEAD_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> AsyncIterator[int]:
    port = free_port()
    config = server_config(app, "127.0.0.1", port, name=name, max_connections=max_connections)
    assert isinstance(config.http, type)
    config.http = type(
        "ShortDeadline",
        (config.http,),
        {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s},
    )
    config.timeout_keep_alive = keep_alive_s
    async with uvicorn_serving(config):
        yield port


async def closed_after(reader: asyncio.StreamReader, limit_s: float = 5.0) -> float:
    """Seconds until the server closes the connection (what it sends is dropped).

    A reset or a broken pipe is a close too: when the server closes while the client is
    still writing, the stream holds that error and raises it from the next read."""
    started = time.monotonic()
    async with asyncio.timeout(limit_s):
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass
    return time.monotonic() - started


async def get(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has sent one request (its answer not read yet)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: admin\r\n\r\n")
    await writer.drain()
    return reader, writer


async def answered(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose one request has been answered."""
    reader, writer = await get(port)
    async with asyncio.timeout(5):
        await reader.readuntil(b"hello")
    return reader, writer


async def test_a_connection_that_sends_nothing_is_closed_at_the_deadline() -> None:
    before = BREACHES["silent", "head_timeout"]
    async with serving(name="silent") as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            took = await closed_after(reader)
        finally:
            writer.close()
    assert HEAD_TIMEOUT_S * 0.8 < took, took  # not before its deadline (closed_after bounds it)
    assert BREACHES["silent", "head_timeout"] == before + 1


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
    assert HEAD_TIMEOUT_S * 0.8 < took, took  # not before its deadline (closed_after bounds it)


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
    before = BREACHES["keep-alive", "head_timeout"]
    async with serving(keep_alive_s=0.5, name="keep-alive") as port:
        reader, writer = await answered(port)
        try:
            writer.write(b"GET / HTT")  # a head begun, never finished
            took = await closed_after(reader)
        finally:
            writer.close()
    assert 0.3 < took, took  # not before the keep-alive timeout (closed_after bounds it)
    assert BREACHES["keep-alive", "head_timeout"] == before + 1


async def test_a_connection_idle_after_its_answers_is_closed_without_a_breach() -> None:
    async with serving(keep_alive_s=0.3, name="idle") as port:
        reader, writer = await answered(port)
        try:
            await closed_after(reader)  # closed (or it raises after 5 s)
        finally:
            writer.close()
    assert BREACHES["idle", "head_timeout"] == 0


async def test_past_the_cap_a_new_peer_evicts_the_connection_nearest_its_head_deadline() -> None:
    before = BREACHES["capped", "max_connections"]
    # a head deadline no slow machine reaches: the silent ones must outlive the eviction
    async with serving(name="capped", max_connections=3, head_timeout_s=30) as port:
        silent = []
        for _ in range(3):
            silent.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0.05)  # opened in order: the first is due first
        reader, writer = await get(port)
        try:
            async with asyncio.timeout(5):
                assert (await reader.readuntil(b"hello")).startswith(b"HTTP/1.1 200")
                assert await silent[0][0].read() == b""  # evicted: closed, nothing sent
            await asyncio.sleep(0.1)
            assert not silent[1][0].at_eof() and not silent[2][0].at_eof()
        finally:
            for _, w in [*silent, (reader, writer)]:
                w.close()
    assert BREACHES["capped", "max_connections"] == before + 1


async def test_past_the_cap_requests_in_progress_are_kept_and_the_new_connection_closed() -> None:
    release = asyncio.Event()

    async def slow(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await hello(scope, receive, send)

    async with serving(app=slow, name="busy", max_connections=2) as port:
        busy = [await get(port) for _ in range(2)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            async with asyncio.timeout(5):
                assert await reader.read() == b""  # closed at once
            release.set()
            async with asyncio.timeout(5):
                for r, _ in busy:
                    assert (await r.readuntil(b"hello")).startswith(b"HTTP/1.1 200")
        finally:
            release.set()
            for _, w in [*busy, (reader, writer)]:
                w.close()
    assert BREACHES["busy", "max_connections"] == 1


def test_the_command_line_sets_the_cap_and_refuses_a_cap_of_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _parser().parse_args(["--http-max-connections=5"]).http_max_connections == 5
    assert _parser().parse_args([]).http_max_connections == MAX_CONNECTIONS
    with pytest.raises(SystemExit):
        _parser().parse_args(["--http-max-connections=0"])
    assert "--http-max-connections: must be at least 1, got 0" in capsys.readouterr().err


async def reads_the_body(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, as the admin API's routes do, then answers."""
    while (await receive()).get("more_body"):
        pass
    await hello(scope, receive, send)


async def trickle(writer: asyncio.StreamWriter, until: asyncio.Event) -> None:
    """A byte of the body every 0.1 s, each read well inside any per-read bound."""
    with contextlib.suppress(ConnectionError):
        while not until.is_set():
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.1)


@pytest.mark.parametrize(
    ("app", "name"), [(reads_the_body, "reads-body"), (hello, "answers-at-once")]
)
async def test_a_body_trickled_a_byte_at_a_time_is_cut_at_its_deadline(
    app: ASGIApp, name: str
) -> None:
    """Whether the app waits for the body or answers without it (the metrics port), a
    body's whole arrival has a deadline: a peer cannot hold a connection by trickling."""
    before = BREACHES[name, "body_timeout"]
    async with serving(app=app, name=name) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        stop = asyncio.Event()
        writer.write(b"POST / HTTP/1.1\r\nhost: admin\r\ncontent-length: 100000\r\n\r\n")
        dripping = asyncio.create_task(trickle(writer, stop))
        try:
            took = await closed_after(reader)
        finally:
            stop.set()
            await dripping
            writer.close()
    assert BODY_TIMEOUT_S * 0.8 < took, took  # not before its deadline (closed_after bounds it)
    assert BREACHES[name, "body_timeout"] == before + 1


async def test_a_body_in_time_leaves_no_deadline_behind() -> None:
    """The body's deadline ends with the body: an app that then takes longer than it to
    answer is not cut."""
    release = asyncio.Event()

    async def slow_after_the_body(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await release.wait()
        await hello(scope, receive, send)

    async with serving(app=slow_after_the_body, name="in-time") as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST / HTTP/1.1\r\nhost: admin\r\ncontent-length: 4\r\n\r\nab")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"cd")  # the body's end, in a read of its own
            await asyncio.sleep(BODY_TIMEOUT_S * 3)
            release.set()
            async with asyncio.timeout(5):
                assert (await reader.readuntil(b"hello")).startswith(b"HTTP/1.1 200")
        finally:
            release.set()
            writer.close()
    assert BREACHES["in-time", "body_timeout"] == 0


async def test_past_the_cap_a_body_nobody_waits_for_is_evicted() -> None:
    """A request answered without its body (the metrics port) whose body still trickles
    makes room for a new peer, like a connection waiting for a head."""
    async with serving(name="body-capped", max_connections=2, body_timeout_s=30) as port:
        stop = asyncio.Event()
        dripping = []
        conns = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nhost: admin\r\ncontent-length: 100000\r\n\r\n")
            async with asyncio.timeout(5):
                await reader.readuntil(b"hello")  # answered, the body still coming
            dripping.append(asyncio.create_task(trickle(writer, stop)))
            conns.append((reader, writer))
        reader, writer = await get(port)
        try:
            async with asyncio.timeout(5):
                assert (await reader.readuntil(b"hello")).startswith(b"HTTP/1.1 200")
            await closed_after(conns[0][0])  # the first one, due first, closed
        finally:
            stop.set()
            await asyncio.gather(*dripping)
            for _, w in [*conns, (reader, writer)]:
                w.close()


async def test_the_next_requests_body_gets_a_deadline_of_its_own() -> None:
    """A body that ends in the same read as the next request begins: the next request's
    body is timed from its own head, not by the one before's deadline."""
    before = BREACHES["next-body", "body_timeout"]
    async with serving(name="next-body") as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = b"POST / HTTP/1.1\r\nhost: admin\r\ncontent-length: 10\r\n\r\n"
            writer.write(head + b"abc")
            await asyncio.sleep(BODY_TIMEOUT_S * 0.6)
            writer.write(b"defghij" + head + b"ab")  # the first body's end, the next head
            await asyncio.sleep(BODY_TIMEOUT_S * 0.7)  # past the first body's deadline
            writer.write(b"cdefghij")  # within the second's
            await writer.drain()
            async with asyncio.timeout(5):
                answers = b""
                while answers.count(b"hello") < 2:
                    chunk = await reader.read(4096)
                    assert chunk, answers
                    answers += chunk
            await asyncio.sleep(0.1)
            assert not reader.at_eof()
        finally:
            writer.close()
    assert BREACHES["next-body", "body_timeout"] == before
