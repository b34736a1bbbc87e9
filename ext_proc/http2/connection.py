"""The server side of one HTTP/2 connection: libnghttp2's protocol on our asyncio transport.

The protocol itself (frames, HPACK, stream states, flow control, acknowledgements)
is the engine's (:mod:`ext_proc.http2.engine`). This class gives it bytes from
each read, hands each stream's data to the layer above in order, writes what
every read produced in one write, and holds every peer to
:class:`~ext_proc.http2.limits.PeerLimits`:

* receive windows are returned only as the layer above takes data
  (:meth:`Http2Connection.consume`): a peer that is not answered cannot send more;
* unfinished messages are charged to the connection's and the process's budget
  (:meth:`Http2Connection.hold_partial`), and a stream whose message stops
  growing for ``partial_message_timeout`` is reset;
* resets of streams whose call had not ended (a rapid-reset attack) are rate limited;
* past ``max_queued_output`` of answers waiting for the peer's windows, new
  messages wait unanswered, holding their window (:attr:`output_backlogged`);
* a peer that has not completed the handshake in ``handshake_timeout``, a
  connection idle for ``idle_timeout`` and a peer that reads nothing of what we
  write (its socket, or its flow-control windows past ``max_queued_output``) for
  ``write_stall_timeout`` are disconnected (:meth:`Http2Connection.tick`,
  called each second by the server);
* the engine's own limits (stream count, CONTINUATION, SETTINGS entries, queued
  acknowledgements, useless frames) end the connection with its GOAWAY.

Each breach is reported once (counted, logged once a minute per peer); GOAWAY
debug data is a fixed text per limit or the engine's, never ours.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, cast

from ext_proc.http2.engine import (
    DataReceived,
    Engine,
    EngineFailure,
    ErrorCode,
    Event,
    GoAwayReceived,
    RequestReceived,
    SettingsReceived,
    StreamClosed,
    StreamReset,
    TrailersReceived,
    goaway_frame,
    goaway_in,
)
from ext_proc.http2.limits import BreachReporter, PartialBudget, PeerLimits, TokenBucket

log = logging.getLogger("prefix_router.ext_proc.http2")

Headers = tuple[tuple[bytes, bytes], ...]

LINGER = 2.0
"""Seconds a connection we end is still read (and what it says dropped), see ``_close_with``."""


class StreamListener(Protocol):
    """The layer above, for one stream: what arrives on it, in order."""

    def data_received(self, data: bytes, end_stream: bool) -> None:
        """Payload of a DATA frame (possibly empty), and whether the client ended the stream.
        The listener calls :meth:`Http2Connection.consume` as it takes the bytes."""

    def reset(self) -> bool:
        """The stream ended abnormally (a RST_STREAM, a timeout, the connection was lost);
        nothing more can be sent on it. True if the call had not ended yet."""

    def resume(self) -> None:
        """The connection's answers no longer wait past ``max_queued_output`` for the
        peer's windows (:attr:`Http2Connection.output_backlogged`): answer what was held."""


OpenStream = Callable[["Http2Connection", int, Headers], StreamListener]
"""Called for each stream the client opens: ``(connection, stream id, request headers)``."""


class ServerContext:
    """What a server's connections share: limits, the process budget, breach reporting."""

    def __init__(
        self, open_stream: OpenStream, limits: PeerLimits, reporter: BreachReporter
    ) -> None:
        self.open_stream = open_stream
        self.limits = limits
        self.reporter = reporter
        self.budget = PartialBudget(limits.process_partial_bytes)
        self.open_calls = 0
        """Streams open on all connections (each holds a call's state)."""


class _Stream:
    __slots__ = ("listener", "unacked", "partial", "progress_at", "opened_at", "silent")

    def __init__(self, now: float) -> None:
        self.opened_at = now
        self.silent = True
        """No byte of a message has arrived on it yet."""
        self.listener: StreamListener | None = None
        self.unacked = 0
        """Bytes received and not yet returned to the peer's window."""
        self.partial = 0
        """Bytes of an unfinished message held by the listener (charged to the budgets)."""
        self.progress_at = 0.0


_GOAWAY_TEXT = {
    "reset_burst": b"too many streams reset",
    "handshake_timeout": b"handshake timeout",
    "write_stall_timeout": b"peer does not read",
    "max_connections": b"too many connections",
    "max_continuations": b"too many CONTINUATION frames",
    "max_queued_acks": b"too many unanswered SETTINGS or PING frames",
    "glitch_burst": b"too many useless frames",
}


class Http2Connection(asyncio.Protocol):
    """One client connection; the context's ``open_stream`` builds each stream's listener."""

    def __init__(
        self, context: ServerContext, on_close: Callable[[Http2Connection], None] | None = None
    ) -> None:
        self._ctx = context
        self._limits = limits = context.limits
        self._on_close = on_close
        self._transport: asyncio.Transport | None = None
        self._engine = Engine(limits)
        self._streams: dict[int, _Stream] = {}
        self._partial = 0
        self._silent = 0
        """Open streams on which no byte of a message has arrived yet."""
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self.opened_at = now
        self._last_activity = now
        self._resets = TokenBucket(limits.reset_burst, limits.reset_rate, now)
        self.peer = "?"
        self.handshaken = False
        self._reading = False
        self._failed = False
        self._going_away = False
        self._write_paused_at: float | None = None
        """Since when the transport's buffer is full (the peer reads nothing)."""
        self._window_stalled_at: float | None = None
        """Since when more than ``max_queued_output`` waits for the peer's windows."""
        self.output_backlogged = False
        """More than ``max_queued_output`` of answers waits for the peer's windows: the
        streams hold new messages unanswered (and their windows with them) meanwhile, so
        a peer that asks without reading gets no more answers queued, only its windows'
        worth of questions held."""
        self._closed = self._loop.create_future()

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self._failed:  # evicted before it was made
            self._transport.abort()
            return
        self.flush()

    def data_received(self, data: bytes) -> None:
        if self._failed:
            return
        self._last_activity = self._loop.time()
        try:
            events = self._engine.receive(data)
        except EngineFailure as failure:
            self._engine_failed(failure)
            return
        self._reading = True
        try:
            for event in events:
                _HANDLERS.get(type(event), _ignore)(self, event)
                if self._failed:
                    return
        finally:
            self._reading = False
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        streams, self._streams = self._streams, {}
        for stream_id, stream in streams.items():
            self._release(stream_id, stream)
            if stream.listener is not None:
                stream.listener.reset()
        if self._on_close is not None:
            self._on_close(self)
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        """The peer reads slower than we write: read no more from it until it catches up."""
        self._write_paused_at = self._loop.time()
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused_at = None
        if self._transport is not None and not self._failed:
            self._transport.resume_reading()

    # -- for the layer above ----------------------------------------------------------------

    def respond(self, stream_id: int, headers: Headers, *, end_stream: bool = False) -> None:
        self._engine.respond(stream_id, headers, end_stream)

    def send_data(self, stream_id: int, data: bytes) -> None:
        """DATA on a stream, held back (in order) while the peer's windows are full."""
        self._engine.send_data(stream_id, data)

    def send_trailers(self, stream_id: int, headers: Headers) -> None:
        self._engine.send_trailers(stream_id, headers)

    def sent(self) -> None:
        """What the layer above queued is to go out: now, or at the end of the current read."""
        if not self._reading:
            self.flush()

    def consume(self, stream_id: int, size: int) -> None:
        """``size`` bytes of the stream's data are taken: the peer may send as much more."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.unacked -= size
        self._engine.consumed(stream_id, size)

    def hold_partial(self, stream_id: int, size: int) -> bool:
        """The stream's listener now holds ``size`` bytes of an unfinished message. False
        (nothing charged) when that is over the connection's or the process's budget."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return size == 0
        delta = size - stream.partial
        budget = self._ctx.budget
        if delta > 0:
            if self._partial + delta > self._limits.connection_partial_bytes:
                self._breach("connection_partial_bytes")
                return False
            if budget.used + delta > budget.limit:
                self._breach("process_partial_bytes")
                return False
            stream.progress_at = self._loop.time()
        stream.partial = size
        self._partial += delta
        budget.used += delta
        return True

    def close_gracefully(self) -> None:
        """GOAWAY: no new streams; the connection closes when its open streams have ended."""
        if self._going_away or self._failed or self._transport is None:
            return
        self._going_away = True
        self._engine.goaway(ErrorCode.NO_ERROR)
        self.flush()

    def abort(self) -> None:
        """Close now; open streams are reset (their listeners are told). Asked before the
        connection is made (a burst of accepts), it closes as soon as it is."""
        self._failed = True
        if self._transport is not None:
            self._transport.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def partial_bytes(self) -> int:
        return self._partial

    # -- timers -----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Enforce the time limits; the server calls this about once a second."""
        if self._transport is None or self._failed:
            return
        limits = self._limits
        if not self.handshaken and now - self.opened_at > limits.handshake_timeout:
            self.fail("handshake_timeout", ErrorCode.PROTOCOL_ERROR)
        elif any(
            since is not None and now - since > limits.write_stall_timeout
            for since in (self._write_paused_at, self._window_stalled_at)
        ):
            self._breach("write_stall_timeout")
            self._failed = True
            self._transport.abort()  # what we would say is what it does not read
        elif not self._streams and now - self._last_activity > limits.idle_timeout:
            self._ctx.reporter.breach("idle_timeout", self.peer, quiet=True)  # routine
            self.close_gracefully()
        elif self._partial or self._silent:
            for stream_id, stream in list(self._streams.items()):
                if stream.partial and now - stream.progress_at > limits.partial_message_timeout:
                    self._breach("partial_message_timeout")
                    self.reset_stream(stream_id, ErrorCode.CANCEL)
                elif stream.silent and now - stream.opened_at > limits.first_message_timeout:
                    self._breach("first_message_timeout")
                    self.reset_stream(stream_id, ErrorCode.CANCEL)
            self.flush()

    # -- events -----------------------------------------------------------------------------

    def _on_settings(self, event: SettingsReceived) -> None:
        self.handshaken = True

    def _on_request(self, event: RequestReceived) -> None:
        stream_id = event.stream_id
        ctx = self._ctx
        if ctx.open_calls >= self._limits.max_open_calls:
            self._breach("max_open_calls")
            self._engine.reset(stream_id, ErrorCode.REFUSED_STREAM)
            return
        ctx.open_calls += 1
        stream = _Stream(self._loop.time())
        self._streams[stream_id] = stream
        self._silent += 1
        listener = self._ctx.open_stream(self, stream_id, event.headers)
        stream.listener = listener
        if event.end_stream:
            stream.silent = False
            self._silent -= 1
            listener.data_received(b"", True)

    def _on_data(self, event: DataReceived) -> None:
        stream_id = event.stream_id
        data = event.data
        stream = self._streams.get(stream_id)
        if stream is None or stream.listener is None:
            self._engine.consumed(stream_id, len(data))
            return
        stream.unacked += len(data)
        if stream.silent and (data or event.end_stream):
            stream.silent = False
            self._silent -= 1
        stream.listener.data_received(data, event.end_stream)

    def _on_trailers(self, event: TrailersReceived) -> None:
        stream = self._streams.get(event.stream_id)
        if stream is not None and stream.listener is not None:
            stream.listener.data_received(b"", True)

    def _on_reset(self, event: StreamReset) -> None:
        busy = self._end_stream(event.stream_id)
        if busy and not self._resets.take(self._loop.time()):
            self.fail("reset_burst")

    def _on_closed(self, event: StreamClosed) -> None:
        self._end_stream(event.stream_id)

    def _on_goaway(self, event: GoAwayReceived) -> None:
        log.debug("peer %s sent GOAWAY (code %d)", self.peer, event.error_code)

    def _end_stream(self, stream_id: int) -> bool:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return False
        self._release(stream_id, stream)
        return stream.listener is not None and stream.listener.reset()

    def _release(self, stream_id: int, stream: _Stream) -> None:
        """Give back what a finished stream held: its window, its share of the budgets."""
        self._ctx.open_calls -= 1
        if stream.silent:
            stream.silent = False
            self._silent -= 1
        if stream.unacked > 0:
            self._engine.consumed(stream_id, stream.unacked)
            stream.unacked = 0
        if stream.partial:
            self._partial -= stream.partial
            self._ctx.budget.used -= stream.partial
            stream.partial = 0

    def reset_stream(self, stream_id: int, code: int) -> None:
        """Reset one stream (its listener is told)."""
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._release(stream_id, stream)
        self._engine.reset(stream_id, code)
        if stream is not None and stream.listener is not None:
            stream.listener.reset()

    # -- writing and failing ----------------------------------------------------------------

    def flush(self) -> None:
        transport = self._transport
        if transport is None or self._failed:  # ended: what is left is never sent
            return
        out = self._engine.output()
        if out:
            transport.write(out)
            if len(self._streams) >= self._limits.max_concurrent_streams and _refused_in(out):
                self._breach("max_concurrent_streams")
        backlogged = self._engine.queued() > self._limits.max_queued_output
        if backlogged:
            if self._window_stalled_at is None:
                self._window_stalled_at = self._loop.time()
        else:
            self._window_stalled_at = None
        if backlogged != self.output_backlogged:
            self.output_backlogged = backlogged
            if not backlogged:
                self._resume_streams()
        if self._engine.done and not self._failed:
            goaway = goaway_in(out) if out else None
            if goaway is not None and goaway[0] != ErrorCode.NO_ERROR:
                self._engine_refused(goaway[0], goaway[1])
            self._close_with(b"")

    def backlogged_now(self) -> bool:
        """Whether the answers queued so far (this read's too) are over
        ``max_queued_output``: checked before each held message is answered, so a resume
        answers only while there is room. Sets :attr:`output_backlogged` when they are."""
        if self._engine.queued() > self._limits.max_queued_output:
            self.output_backlogged = True
        return self.output_backlogged

    def _resume_streams(self) -> None:
        """The answers' backlog is below ``max_queued_output`` again: the streams answer
        the messages they held meanwhile, until it is over again."""
        reading, self._reading = self._reading, True  # one write for all, below
        try:
            for stream in list(self._streams.values()):
                if self._failed or self.backlogged_now():  # over again: the rest wait
                    break
                if stream.listener is not None:
                    stream.listener.resume()
        finally:
            self._reading = reading
        if not reading:
            self.flush()

    def _engine_refused(self, code: int, debug: bytes) -> None:
        """The engine ended the connection with a GOAWAY of its own: count why."""
        if code == ErrorCode.ENHANCE_YOUR_CALM:
            limit = "max_settings_entries" if b"SETTINGS" in debug else "glitch_burst"
            self._breach(limit)
        elif b"max concurrent streams" in debug:  # past it once the peer has our SETTINGS
            self._breach("max_concurrent_streams")
        else:
            self._breach("protocol_error", f"code {code}")

    def _engine_failed(self, failure: EngineFailure) -> None:
        self._breach(failure.limit or "protocol_error", "" if failure.limit else str(failure))
        debug = _GOAWAY_TEXT.get(failure.limit or "", b"")
        self._close_with(goaway_frame(failure.code, debug))

    def fail(self, limit: str, code: int = ErrorCode.ENHANCE_YOUR_CALM) -> None:
        """End the connection for breaching ``limit``: GOAWAY ``code``, then close."""
        if self._failed:
            return
        self._breach(limit)
        self._engine.goaway(code, _GOAWAY_TEXT.get(limit, b""))
        out = self._engine.output()
        if goaway_in(out) is None:  # the engine had stopped writing
            out += goaway_frame(code, _GOAWAY_TEXT.get(limit, b""))
        self._close_with(out)

    def _close_with(self, out: bytes) -> None:
        """Write ``out`` (a GOAWAY), then close. Our side is shut at once and theirs read
        and dropped for :data:`LINGER` seconds: closing a socket with unread input resets
        the connection, and the reset can destroy the GOAWAY before the peer reads it."""
        self._failed = True
        transport = self._transport
        if transport is None:
            return
        if out:
            transport.write(out)
        try:
            if transport.can_write_eof():
                transport.write_eof()
                self._loop.call_later(LINGER, transport.abort)
                return
        except OSError:  # the peer is gone already
            pass
        transport.close()

    def _breach(self, limit: str, detail: str = "") -> None:
        self._ctx.reporter.breach(limit, self.peer, detail)


def _refused_in(output: bytes) -> bool:
    """Whether ``output`` resets a stream: the engine refusing one past the stream limit."""
    pos = 0
    while pos + 9 <= len(output):
        if output[pos + 3] == 0x3:
            return True
        pos += 9 + int.from_bytes(output[pos : pos + 3], "big")
    return False


def _ignore(conn: Http2Connection, event: Event) -> None:
    pass


_HANDLERS: dict[type, Callable[[Http2Connection, object], None]] = {
    RequestReceived: Http2Connection._on_request,  # type: ignore[dict-item]
    DataReceived: Http2Connection._on_data,  # type: ignore[dict-item]
    TrailersReceived: Http2Connection._on_trailers,  # type: ignore[dict-item]
    StreamReset: Http2Connection._on_reset,  # type: ignore[dict-item]
    StreamClosed: Http2Connection._on_closed,  # type: ignore[dict-item]
    SettingsReceived: Http2Connection._on_settings,  # type: ignore[dict-item]
    GoAwayReceived: Http2Connection._on_goaway,  # type: ignore[dict-item]
}
