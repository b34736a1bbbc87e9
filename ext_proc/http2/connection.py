"""The server side of one HTTP/2 connection (RFC 9113), as an asyncio protocol.

Why our own: ext_proc costs Envoy two gRPC messages a request, and grpcio's
asyncio server spends most of a request's CPU in its per-message machinery
(completion queues, a poller thread, a future per operation). This protocol
does what a gRPC server needs of HTTP/2 and nothing else, on the event loop's
own callbacks: it parses frames from each read, hands each stream's data to
the layer above in order, and writes everything a read produced in one write.

What it implements: the connection preface and SETTINGS exchange (both ways,
with ACKs), streams opened by the client's HEADERS (+ CONTINUATION, padding
and priority fields stripped), DATA with END_STREAM, RST_STREAM, PING, GOAWAY
(both ways, and a graceful :meth:`Http2Connection.close_gracefully`), and flow
control both ways: the receive windows are topped up as data arrives (the
layer above bounds what it buffers), the send windows hold back what the peer
has no room for until its WINDOW_UPDATE. The client's header blocks are decoded
with the ``hpack`` package, once per distinct block (we ask the client not to use
its dynamic table: :mod:`ext_proc.http2.header_decoding`); ours are HPACK literals
that never touch the client's table (:mod:`ext_proc.http2.frames`). No server push,
no priorities (both optional to honour), no TLS (Envoy reaches ext_proc over plain TCP).

Protocol violations end the connection with a GOAWAY that names the error
(a connection error) or reset one stream (a stream error), as the RFC says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, cast

import hpack

from ext_proc.http2.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_WINDOW,
    MAX_WINDOW,
    PREFACE,
    ErrorCode,
    Flag,
    FrameType,
    H2ConnectionError,
    H2StreamError,
    Setting,
    encode_frame,
    encode_goaway,
    encode_rst_stream,
    encode_settings,
    encode_window_update,
    header_block_fragment,
    parse_goaway,
    parse_rst_stream,
    parse_settings,
    parse_window_increment,
    split_frames,
    strip_padding,
)
from ext_proc.http2.header_decoding import TABLE_SIZE as HEADER_TABLE_SIZE
from ext_proc.http2.header_decoding import HeaderBlockDecoder, Headers

log = logging.getLogger("prefix_router.ext_proc.http2")


STREAM_WINDOW = 16 * 1024 * 1024
"""Receive window we give each stream: a 16 MiB body arrives without waiting for us."""
CONNECTION_WINDOW = 256 * 1024 * 1024
MAX_FRAME_SIZE = 1024 * 1024
"""Largest frame we accept: big bodies arrive in fewer frames than the default 16 KiB."""
MAX_HEADER_LIST_SIZE = 64 * 1024


class StreamListener(Protocol):
    """The layer above, for one stream: what arrives on it, in order."""

    def data_received(self, data: bytes, end_stream: bool) -> None:
        """Payload of a DATA frame (possibly empty), and whether the client ended the stream."""

    def reset(self) -> None:
        """The stream ended abnormally: a RST_STREAM from the client, or the connection
        was lost. Nothing more can be sent on it."""


OpenStream = Callable[["Http2Connection", int, Headers], StreamListener]
"""Called for each stream the client opens: ``(connection, stream id, request headers)``."""


class _Stream:
    __slots__ = (
        "id",
        "listener",
        "send_window",
        "recv_window",
        "backlog",
        "remote_closed",
        "local_closed",
    )

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.listener: StreamListener | None = None
        self.send_window = send_window
        self.recv_window = STREAM_WINDOW
        self.backlog: list[tuple[bytes, bool, bool]] = []
        """(payload, is_data, end_stream) waiting for flow-control room, in order."""
        self.remote_closed = False
        self.local_closed = False


class Http2Connection(asyncio.Protocol):
    """One client connection; ``open_stream`` builds the listener of each new stream."""

    def __init__(
        self, open_stream: OpenStream, on_close: Callable[[Http2Connection], None] | None = None
    ) -> None:
        self._open_stream = open_stream
        self._on_close = on_close
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._preface_seen = False
        self._decoder = HeaderBlockDecoder(MAX_HEADER_LIST_SIZE)
        self._streams: dict[int, _Stream] = {}
        self._last_stream_id = 0
        self._continuation: tuple[int, int, bytearray] | None = None
        """(stream id, HEADERS flags, header block so far) while CONTINUATION frames follow."""
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME_SIZE
        self._send_window = DEFAULT_WINDOW
        self._recv_window = CONNECTION_WINDOW
        self._out: list[bytes] | None = None
        """Frames not yet written: they go out in one write at the end of the read, or of
        the event-loop iteration, that produced them."""
        self._reading = False
        self._going_away = False
        self._close_after_write = False
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        transport.write(
            encode_settings(
                [
                    (Setting.HEADER_TABLE_SIZE, HEADER_TABLE_SIZE),
                    (Setting.ENABLE_PUSH, 0),
                    (Setting.INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                    (Setting.MAX_FRAME_SIZE, MAX_FRAME_SIZE),
                    (Setting.MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST_SIZE),
                ]
            )
            + encode_window_update(0, CONNECTION_WINDOW - DEFAULT_WINDOW)
        )

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if not self._preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._fail(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if buffer[: len(PREFACE)] != PREFACE:
                self._fail(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            del buffer[: len(PREFACE)]
            self._preface_seen = True
        self._reading = True
        try:
            for kind, flags, stream_id, payload in split_frames(buffer, MAX_FRAME_SIZE):
                self._on_frame(kind, flags, stream_id, payload)
        except H2ConnectionError as exc:
            self._flush()
            self._fail(exc.code, str(exc))
            return
        finally:
            self._reading = False
        self._flush()

    def pause_writing(self) -> None:
        """The peer reads slower than we answer: read no more until it catches up."""
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if stream.listener is not None:
                stream.listener.reset()
        self._transport = None
        if not self._closed.done():
            self._closed.set_result(None)
        if self._on_close is not None:
            self._on_close(self)

    # -- what the layer above sends ---------------------------------------------------------

    def send_headers(self, stream_id: int, block: bytes, *, end_stream: bool = False) -> None:
        """A header block (response headers, or trailers with ``end_stream``)."""
        self._send(stream_id, block, is_data=False, end_stream=end_stream)

    def send_data(self, stream_id: int, data: bytes, *, end_stream: bool = False) -> None:
        """DATA on a stream, held back (in order) while the peer's windows are full."""
        self._send(stream_id, data, is_data=True, end_stream=end_stream)

    def close_gracefully(self) -> None:
        """GOAWAY: no new streams; the connection closes when its open streams have ended."""
        if self._going_away or self._transport is None:
            return
        self._going_away = True
        self._write(encode_goaway(self._last_stream_id, ErrorCode.NO_ERROR))
        self._close_if_gone_away()

    def abort(self) -> None:
        """Close now; open streams are reset (their listeners are told)."""
        if self._transport is not None:
            self._transport.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- frames -----------------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != FrameType.CONTINUATION:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "header block interrupted")
        if kind == FrameType.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == FrameType.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == FrameType.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == FrameType.CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == FrameType.RST_STREAM:
            self._on_rst_stream(stream_id, payload)
        elif kind == FrameType.SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == FrameType.PING:
            if stream_id != 0 or len(payload) != 8:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "malformed PING")
            if not flags & Flag.ACK:
                self._write(encode_frame(FrameType.PING, Flag.ACK, 0, payload))
        elif kind == FrameType.GOAWAY:
            last, code = parse_goaway(payload)
            log.debug("peer sent GOAWAY (last stream %d, code %d)", last, code)
        elif kind == FrameType.PRIORITY:
            if stream_id == 0 or len(payload) != 5:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "malformed PRIORITY")
        elif kind == FrameType.PUSH_PROMISE:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "a client cannot push")
        # frames of unknown types are ignored (RFC 9113 section 4.1)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "connection window exceeded")
        if self._recv_window < CONNECTION_WINDOW // 2:
            self._write(encode_window_update(0, CONNECTION_WINDOW - self._recv_window))
            self._recv_window = CONNECTION_WINDOW
        stream = self._streams.get(stream_id)
        if stream is None or stream.remote_closed:
            if stream_id > self._last_stream_id:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:  # half-closed (remote): a stream error
                self._stream_error(
                    H2StreamError(stream_id, ErrorCode.STREAM_CLOSED, "DATA after END_STREAM")
                )
            return  # a stream we closed or reset: its data is dropped
        stream.recv_window -= size
        if stream.recv_window < 0:
            self._stream_error(
                H2StreamError(stream_id, ErrorCode.FLOW_CONTROL_ERROR, "stream window exceeded")
            )
            return
        if stream.recv_window < STREAM_WINDOW // 2 and not flags & Flag.END_STREAM:
            self._write(encode_window_update(stream_id, STREAM_WINDOW - stream.recv_window))
            stream.recv_window = STREAM_WINDOW
        end = bool(flags & Flag.END_STREAM)
        if end:
            stream.remote_closed = True
        assert stream.listener is not None
        stream.listener.data_received(strip_padding(flags, payload), end)
        if end:
            self._forget_if_done(stream)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        fragment = header_block_fragment(flags, payload)
        if flags & Flag.END_HEADERS:
            self._on_header_block(stream_id, flags, fragment)
        else:
            self._continuation = (stream_id, flags, bytearray(fragment))

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        pending = self._continuation
        if pending is None or pending[0] != stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "unexpected CONTINUATION")
        pending[2].extend(payload)
        if len(pending[2]) > MAX_HEADER_LIST_SIZE * 2:
            raise H2ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if flags & Flag.END_HEADERS:
            self._continuation = None
            self._on_header_block(stream_id, pending[1], bytes(pending[2]))

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:  # decoded even for a stream we refuse: the decoder's table must follow
            headers = self._decoder.decode(block)
        except (hpack.HPACKError, ValueError) as exc:
            raise H2ConnectionError(
                ErrorCode.COMPRESSION_ERROR, f"bad header block: {exc}"
            ) from exc
        if stream_id == 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        end = bool(flags & Flag.END_STREAM)
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers of a stream we know
            if not end or stream.remote_closed:
                self._stream_error(
                    H2StreamError(
                        stream_id, ErrorCode.PROTOCOL_ERROR, "second HEADERS without END_STREAM"
                    )
                )
                return
            stream.remote_closed = True
            assert stream.listener is not None
            stream.listener.data_received(b"", True)
            self._forget_if_done(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self._last_stream_id:
            raise H2ConnectionError(
                ErrorCode.PROTOCOL_ERROR, f"stream {stream_id} cannot be opened by the client"
            )
        self._last_stream_id = stream_id
        if self._going_away:
            self._write(encode_rst_stream(stream_id, ErrorCode.REFUSED_STREAM))
            return
        stream = _Stream(stream_id, self._peer_initial_window)
        self._streams[stream_id] = stream
        stream.listener = self._open_stream(self, stream_id, headers)
        if end:
            stream.remote_closed = True
            stream.listener.data_received(b"", True)
            self._forget_if_done(stream)

    def _on_rst_stream(self, stream_id: int, payload: bytes) -> None:
        code = parse_rst_stream(payload)
        if stream_id == 0 or stream_id > self._last_stream_id:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        stream = self._streams.pop(stream_id, None)
        if stream is not None and stream.listener is not None:
            log.debug("stream %d reset by the peer (code %d)", stream_id, code)
            stream.listener.reset()
        self._close_if_gone_away()

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & Flag.ACK:
            if payload:
                raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with payload")
            return
        for ident, value in parse_settings(payload):
            if ident == Setting.INITIAL_WINDOW_SIZE:
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise H2ConnectionError(
                            ErrorCode.FLOW_CONTROL_ERROR, "a stream window grew past 2^31-1"
                        )
            elif ident == Setting.MAX_FRAME_SIZE:
                self._peer_max_frame = value
        self._write(encode_frame(FrameType.SETTINGS, Flag.ACK, 0))
        self._flush_backlogs()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        increment = parse_window_increment(payload)
        if stream_id == 0:
            if increment == 0:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise H2ConnectionError(
                    ErrorCode.FLOW_CONTROL_ERROR, "connection window grew past 2^31-1"
                )
            self._flush_backlogs()
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # closed meanwhile (or never opened: harmless)
        if increment == 0:
            self._stream_error(
                H2StreamError(stream_id, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            )
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(
                H2StreamError(
                    stream_id, ErrorCode.FLOW_CONTROL_ERROR, "stream window grew past 2^31-1"
                )
            )
            return
        if stream.backlog:
            self._flush_backlog(stream)

    # -- sending ----------------------------------------------------------------------------

    def _send(self, stream_id: int, payload: bytes, *, is_data: bool, end_stream: bool) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed or self._transport is None:
            return  # reset or closed meanwhile: nobody to tell
        if end_stream:
            stream.local_closed = True
        if stream.backlog:
            stream.backlog.append((payload, is_data, end_stream))
        elif self._send_now(stream, payload, is_data, end_stream) and end_stream:
            self._forget_if_done(stream)

    def _send_now(self, stream: _Stream, payload: bytes, is_data: bool, end_stream: bool) -> bool:
        """Write what flow control allows now; keep the rest in the stream's backlog.
        True when all of it was written."""
        flags = Flag.END_STREAM if end_stream else 0
        if not is_data:
            self._write(
                encode_frame(FrameType.HEADERS, flags | Flag.END_HEADERS, stream.id, payload)
            )
            return True
        view = memoryview(payload)
        while True:
            room = min(self._send_window, stream.send_window, self._peer_max_frame)
            if len(view) <= room:
                size = len(view)
                self._write(encode_frame(FrameType.DATA, flags, stream.id, bytes(view)))
                self._send_window -= size
                stream.send_window -= size
                return True
            if room > 0:
                self._write(encode_frame(FrameType.DATA, 0, stream.id, bytes(view[:room])))
                self._send_window -= room
                stream.send_window -= room
                view = view[room:]
            if room <= 0 or (self._send_window <= 0 or stream.send_window <= 0):
                stream.backlog.insert(0, (bytes(view), True, end_stream))
                return False

    def _flush_backlog(self, stream: _Stream) -> None:
        backlog, stream.backlog = stream.backlog, []
        for index, (payload, is_data, end_stream) in enumerate(backlog):
            if not self._send_now(stream, payload, is_data, end_stream):
                stream.backlog.extend(backlog[index + 1 :])
                return
            if end_stream:
                self._forget_if_done(stream)

    def _flush_backlogs(self) -> None:
        for stream in [s for s in self._streams.values() if s.backlog]:
            if self._send_window <= 0:
                return
            self._flush_backlog(stream)

    def _forget_if_done(self, stream: _Stream) -> None:
        """A stream is done when both sides have ended it and all we sent is written.
        Ending first, we let the client end its side rather than reset the stream: a
        client that is still sending would report its failed send instead of our status."""
        if stream.remote_closed and stream.local_closed and not stream.backlog:
            self._streams.pop(stream.id, None)
            self._close_if_gone_away()

    def _close_if_gone_away(self) -> None:
        if self._going_away and not self._streams and self._transport is not None:
            if self._out is None:
                self._transport.close()
            else:
                self._close_after_write = True

    def _write(self, frame: bytes) -> None:
        out = self._out
        if out is not None:
            out.append(frame)
            return
        self._out = [frame]
        if not self._reading:  # an answer that was awaited: others may join it this turn
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, None
        transport = self._transport
        if out and transport is not None:
            transport.write(b"".join(out) if len(out) > 1 else out[0])
            if self._close_after_write:
                transport.close()

    # -- errors -----------------------------------------------------------------------------

    def _stream_error(self, error: H2StreamError) -> None:
        log.debug("stream %d: %s", error.stream_id, error)
        stream = self._streams.pop(error.stream_id, None)
        self._write(encode_rst_stream(error.stream_id, error.code))
        if stream is not None and stream.listener is not None:
            stream.listener.reset()
        self._close_if_gone_away()

    def _fail(self, code: ErrorCode, message: str) -> None:
        log.warning("HTTP/2 connection error %s: %s", code.name, message)
        if self._transport is not None:
            self._flush()
            self._transport.write(encode_goaway(self._last_stream_id, code, message))
            self._transport.close()
