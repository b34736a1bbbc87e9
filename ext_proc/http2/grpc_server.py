"""gRPC over our HTTP/2 connection: calls, message framing, status, the listening server.

A gRPC call is one HTTP/2 stream: request headers (``:method POST``, ``:path
/service/Method``, ``content-type: application/grpc...``), then length-prefixed
messages each way (1 byte compressed flag, 4 bytes length, the message), then the
server's trailers carry ``grpc-status`` (and ``grpc-message``). See
https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md.

A method is a factory of :class:`MessageHandler` objects, one per call. The
handler answers each request message in order, synchronously (bytes, or None for
no answer) or with an awaitable for answers that wait on I/O; a message that
arrives while an answer is pending waits its turn. When the client ends its side
the call ends with status OK once every answer is out; a handler ends it early
by raising :class:`GrpcError`. ``on_end`` tells the handler the call is over, and
whether the client cancelled it (RST_STREAM, or the connection was lost): the
one place to give back what the call holds. Unary methods are the same thing:
one message in, one answer, then the client's end.

Messages are bytes: the handler parses and serializes its own protobufs, so the
hot path pays for exactly one parse and one serialization.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from enum import IntEnum
from typing import Any, Protocol
from urllib.parse import quote

from ext_proc.http2.connection import Headers, Http2Connection, ServerContext
from ext_proc.http2.engine import ErrorCode, goaway_frame
from ext_proc.http2.limits import BreachReporter, PeerLimits

log = logging.getLogger("prefix_router.ext_proc.http2")

MAX_MESSAGE_BYTES = PeerLimits().max_message_bytes
"""Largest request message accepted by default: a 64 MiB body and its envelope."""


class StatusCode(IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNAVAILABLE = 14
    UNIMPLEMENTED = 12


class GrpcError(Exception):
    """Raised by a handler to end its call with ``code`` and ``message``."""

    def __init__(self, code: StatusCode, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Answer = bytes | None | Awaitable[bytes | None]


class MessageHandler(Protocol):
    """One call of a method, from the server's side."""

    def on_message(self, message: bytes) -> Answer:
        """Answer one request message: bytes, None (no answer), or an awaitable of either."""

    def on_end(self, cancelled: bool) -> None:
        """The call is over; ``cancelled`` if the client reset it or went away."""


Method = Callable[[], MessageHandler]


RESPONSE_HEADERS: Headers = ((b":status", b"200"), (b"content-type", b"application/grpc"))


def trailers(code: StatusCode, message: str = "") -> Headers:
    """The trailing header block of a call that ends with ``code``."""
    status = (b"grpc-status", str(int(code)).encode())
    if not message:
        return (status,)
    text = quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
    return (status, (b"grpc-message", text.encode()))


OK_TRAILERS = trailers(StatusCode.OK)


def frame_message(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def _start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A task for ``coro``, started at once where asyncio can (3.12+: its first step runs
    now, and an answer that needs no I/O goes out in this turn of the loop)."""
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, eager_start=True)  # type: ignore[call-arg,unused-ignore]
    return asyncio.ensure_future(coro)


class GrpcCall:
    """The listener of one stream: reassembles messages, runs the handler, answers in order.

    Flow control: the bytes of a message are given back to the peer's window when the
    handler takes the message, and the bytes of an unfinished message as they are
    charged to the budgets (:meth:`Http2Connection.hold_partial`); a message that
    waits for an earlier answer holds its window, so a peer cannot queue more than
    its window of work on a stream.
    """

    __slots__ = (
        "_conn",
        "_id",
        "_handler",
        "_max_message",
        "_buffer",
        "_pending",
        "_backlog",
        "_backlog_bytes",
        "_unacked",
        "_client_done",
        "_headers_sent",
        "_over",
    )

    def __init__(
        self, conn: Http2Connection, stream_id: int, handler: MessageHandler, max_message: int
    ) -> None:
        self._conn = conn
        self._id = stream_id
        self._handler = handler
        self._max_message = max_message
        self._buffer = bytearray()
        self._pending: asyncio.Task[None] | None = None
        self._backlog: deque[bytes] = deque()
        self._backlog_bytes = 0
        self._unacked = 0
        self._client_done = False
        self._headers_sent = False
        self._over = False

    # -- StreamListener ---------------------------------------------------------------------

    def data_received(self, data: bytes, end_stream: bool) -> None:
        if data:
            self._unacked += len(data)
            if not self._over:
                self._take(data)
            self._settle()
        if end_stream and not self._over:
            self._client_done = True
            if self._buffer:  # the client ended in the middle of a message
                self._fail(StatusCode.INTERNAL, "the request ended inside a message")
            elif self._pending is None and not self._backlog:
                self._finish(StatusCode.OK)

    def reset(self) -> bool:
        if self._over:
            return False
        self._over = True
        self._handler.on_end(True)
        return True

    # -- messages ---------------------------------------------------------------------------

    def _take(self, data: bytes) -> None:
        buffer = self._buffer
        if not buffer and len(data) >= 5 and data[0] == 0:  # the common case: whole messages
            size = int.from_bytes(data[1:5], "big")
            if len(data) == 5 + size and size <= self._max_message:
                self._deliver(data[5:])
                return
        had_partial = bool(buffer)
        buffer += data
        while len(buffer) >= 5 and not self._over:
            if buffer[0] != 0:
                self._fail(StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
                return
            size = int.from_bytes(buffer[1:5], "big")
            if size > self._max_message:
                self._fail(
                    StatusCode.RESOURCE_EXHAUSTED,
                    f"message of {size} bytes exceeds {self._max_message}",
                )
                return
            if len(buffer) < 5 + size:
                break
            message = bytes(buffer[5 : 5 + size])
            del buffer[: 5 + size]
            self._deliver(message)
        if (buffer or had_partial) and not self._over:
            if not self._conn.hold_partial(self._id, len(buffer)):
                self._fail(StatusCode.RESOURCE_EXHAUSTED, "unfinished messages over budget")

    def resume(self) -> None:
        if self._pending is None and not self._over:
            self._answer_backlog()
            self._settle()
            self._finish_if_done()

    def _deliver(self, message: bytes) -> None:
        if self._pending is not None or self._backlog or self._conn.output_backlogged:
            self._backlog.append(message)
            self._backlog_bytes += 5 + len(message)
            return
        self._answer(message)

    def _settle(self) -> None:
        """Give back the window of every byte taken: all but the waiting messages'."""
        extra = self._unacked - self._backlog_bytes
        if extra > 0:
            self._unacked -= extra
            self._conn.consume(self._id, extra)

    def _answer(self, message: bytes) -> None:
        try:
            answer = self._handler.on_message(message)
        except GrpcError as exc:
            self._fail(exc.code, exc.message)
            return
        except Exception:
            log.exception("handler failed")
            self._fail(StatusCode.INTERNAL, "internal error")
            return
        if isinstance(answer, bytes):
            self._send(answer)
        elif answer is not None:
            task = _start(self._await(answer))
            if not task.done():  # (an eager task may have answered already)
                self._pending = task

    async def _await(self, answer: Awaitable[bytes | None]) -> None:
        """Wait for an answer and send it from this task's own step: a done callback
        would wait one more turn of the event loop."""
        try:
            result = await answer
        except asyncio.CancelledError as exc:
            self._answered(None, exc)
            raise
        except Exception as exc:
            self._answered(None, exc)
        else:
            self._answered(result, None)

    def _answered(self, answer: bytes | None, exc: BaseException | None) -> None:
        self._pending = None
        if self._over:
            return  # cancelled meanwhile: the handler knows (on_end) and cleans up
        if exc is not None:
            if isinstance(exc, GrpcError):
                self._fail(exc.code, exc.message)
            else:
                log.error("handler failed", exc_info=exc)
                self._fail(StatusCode.INTERNAL, "internal error")
            self._conn.sent()
            return
        if answer is not None:
            self._send(answer)
        self._answer_backlog()
        self._settle()
        self._finish_if_done()
        self._conn.sent()

    def _answer_backlog(self) -> None:
        """Answer the messages that waited, in order, while nothing holds them back."""
        conn = self._conn
        while self._backlog and self._pending is None and not self._over:
            if conn.backlogged_now():
                return
            message = self._backlog.popleft()
            self._backlog_bytes -= 5 + len(message)
            self._answer(message)

    def _finish_if_done(self) -> None:
        if self._client_done and self._pending is None and not self._backlog and not self._over:
            self._finish(StatusCode.OK)

    # -- answers ----------------------------------------------------------------------------

    def _send(self, message: bytes) -> None:
        if not self._headers_sent:
            self._headers_sent = True
            self._conn.respond(self._id, RESPONSE_HEADERS)
        self._conn.send_data(self._id, frame_message(message))

    def _finish(self, code: StatusCode, message: str = "") -> None:
        self._over = True
        if self._headers_sent:
            self._conn.send_trailers(
                self._id, OK_TRAILERS if code is StatusCode.OK else trailers(code, message)
            )
        else:  # "trailers-only"
            self._conn.respond(
                self._id, RESPONSE_HEADERS + trailers(code, message), end_stream=True
            )
        self._handler.on_end(False)

    def _fail(self, code: StatusCode, message: str) -> None:
        self._backlog.clear()
        self._backlog_bytes = 0
        if self._buffer:
            self._buffer.clear()
            self._conn.hold_partial(self._id, 0)
        self._finish(code, message)

    def end(self, code: StatusCode, message: str) -> None:
        """End the call now, with ``code``, whatever the client still sends."""
        if not self._over:
            self._fail(code, message)


class _Refused:
    """The handler of a call refused at its start: nothing to answer, nothing to give back."""

    def on_message(self, message: bytes) -> Answer:
        return None

    def on_end(self, cancelled: bool) -> None:
        pass


def _header(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


class _Refuser(asyncio.Protocol):
    """A connection over the process's cap: told so (GOAWAY), then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(goaway_frame(ErrorCode.ENHANCE_YOUR_CALM, b"too many connections"))  # type: ignore[attr-defined]
        transport.close()


class GrpcServer:
    """Serves ``methods`` (``"/package.Service/Method"`` -> factory) on one TCP port, holding
    every peer to ``limits``; ``on_breach(limit)`` counts each breach (a metric)."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        limits: PeerLimits | None = None,
        on_breach: Callable[[str], None] | None = None,
    ) -> None:
        self._methods = {path.encode(): factory for path, factory in methods.items()}
        self.limits = limits = limits or PeerLimits()
        self.reporter = BreachReporter(on_breach)
        self._context = ServerContext(self._open_call, limits, self.reporter)
        self._connections: dict[Http2Connection, None] = {}
        """Open connections, oldest first."""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_every = min(
            1.0,
            limits.handshake_timeout / 4,
            limits.idle_timeout / 4,
            limits.write_stall_timeout / 4,
            limits.partial_message_timeout / 4,
            limits.first_message_timeout / 4,
        )

    def _open_call(self, conn: Http2Connection, stream_id: int, headers: Headers) -> GrpcCall:
        path = _header(headers, b":path") or b""
        factory = self._methods.get(path)
        content_type = _header(headers, b"content-type") or b""
        refusal = None
        if _header(headers, b":method") != b"POST":
            refusal = "gRPC calls are POST requests"
        elif not content_type.startswith(b"application/grpc"):
            refusal = "content-type is not application/grpc"
        elif _header(headers, b"grpc-encoding") not in (None, b"identity"):
            refusal = "compressed calls are not supported"
        elif factory is None:
            refusal = f"unknown method {path.decode('latin-1')}"
        max_message = self.limits.max_message_bytes
        if refusal is None:
            assert factory is not None
            return GrpcCall(conn, stream_id, factory(), max_message)
        call = GrpcCall(conn, stream_id, _Refused(), max_message)
        call.end(StatusCode.UNIMPLEMENTED, refusal)
        return call

    def _connection(self) -> asyncio.Protocol:
        if len(self._connections) >= self.limits.max_connections:
            # make room by the oldest connection still without a handshake, else the
            # oldest without a call open (an Envoy's idle one reconnects), if any
            waiting = next((c for c in self._connections if not c.handshaken), None) or next(
                (c for c in self._connections if c.open_streams == 0), None
            )
            self.reporter.breach("max_connections", waiting.peer if waiting else "?")
            if waiting is None:
                return _Refuser()
            self._connections.pop(waiting, None)
            waiting.abort()
        conn = Http2Connection(self._context, on_close=self._forget)
        self._connections[conn] = None
        return conn

    def _forget(self, conn: Http2Connection) -> None:
        self._connections.pop(conn, None)

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in list(self._connections):
            conn.tick(now)
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._connection, host, port, reuse_address=True, backlog=1024
        )
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def open_calls(self) -> int:
        return sum(c.open_streams for c in self._connections)

    @property
    def connections(self) -> int:
        return len(self._connections)

    @property
    def partial_bytes(self) -> int:
        """Bytes of unfinished request messages held by all connections."""
        return self._context.budget.used

    async def stop(self, grace: float) -> None:
        """Stop listening, let open calls end within ``grace`` seconds, then cut the rest."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        for conn in connections:
            conn.close_gracefully()
        if connections:
            _, late = await asyncio.wait(
                [asyncio.ensure_future(c.wait_closed()) for c in connections], timeout=grace
            )
            for conn in connections:
                conn.abort()
            if late:
                await asyncio.wait(late, timeout=1.0)
        if self._server is not None:
            await self._server.wait_closed()
