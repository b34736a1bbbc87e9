"""The HTTP/2 protocol engine: libnghttp2, through the ``ngh2`` binding. The only module
that imports ``ngh2``: swapping the engine means rewriting this file alone.

libnghttp2 (the HTTP/2 of curl, Node.js, Apache httpd) does the protocol: frames,
HPACK both ways, stream states, flow control both ways, SETTINGS and PING
acknowledgements, GOAWAY, and the checks a network-facing server needs (stream
limits, CONTINUATION and SETTINGS-entry limits, a cap on queued acknowledgements,
a rate limit on useless frames). It is sans-IO: :meth:`Engine.receive` takes bytes
and returns events, :meth:`Engine.output` gives what to write. The asyncio
transport, timers and budgets are ours (:mod:`ext_proc.http2.connection`).

Received data is acknowledged by us (:meth:`Engine.consumed`), never automatically:
the receive windows open only as the gRPC layer takes messages.

When the engine can no longer be used (a bad preface, a flood it detected while
parsing) :meth:`Engine.receive` raises :class:`EngineFailure` with the error code
and the limit to count; the connection then writes :func:`goaway_frame` itself.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import ngh2
from ngh2 import (
    ConnectionClosed,
    DataReceived,
    ErrorCode,
    Event,
    GoAwayReceived,
    RequestReceived,
    SettingsReceived,
    StreamClosed,
    StreamReset,
    TrailersReceived,
)

from ext_proc.http2.limits import PeerLimits

__all__ = [
    "ConnectionClosed",
    "DataReceived",
    "Engine",
    "EngineFailure",
    "ErrorCode",
    "Event",
    "GoAwayReceived",
    "RequestReceived",
    "SettingsReceived",
    "StreamClosed",
    "StreamReset",
    "TrailersReceived",
    "goaway_frame",
    "goaway_in",
    "VERSION",
]

VERSION = f"ngh2 {ngh2.__version__}"

Header = tuple[bytes, bytes]

_UNLIMITED = 2**62
"""nghttp2 counts every RST_STREAM; ours (:class:`~ext_proc.http2.limits.PeerLimits`
``reset_burst``) counts resets of calls that had not ended, and is a setting: nghttp2's
own count is left out of the way."""


class EngineFailure(Exception):
    """The engine refused the peer's input and cannot go on: GOAWAY ``code``, then close."""

    def __init__(self, code: ErrorCode, limit: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.limit = limit
        """The :class:`PeerLimits` field breached, or None for a plain protocol error."""


def _failure(exc: ngh2.NGH2Error) -> EngineFailure:
    text = str(exc)
    if isinstance(exc, ngh2.DenialOfServiceError):
        lowered = text.lower()
        if "continuation" in lowered:
            limit = "max_continuations"
        elif "flood" in lowered:
            limit = "max_queued_acks"
        else:
            limit = "glitch_burst"
        return EngineFailure(ErrorCode.ENHANCE_YOUR_CALM, limit, text)
    return EngineFailure(ErrorCode.PROTOCOL_ERROR, None, text)


def goaway_frame(code: int, debug: bytes = b"", last_stream_id: int = 0) -> bytes:
    """A GOAWAY frame, for a connection whose engine can no longer write one."""
    payload = struct.pack(">LL", last_stream_id, code) + debug
    return struct.pack(">BHBBL", 0, len(payload), 0x7, 0, 0) + payload


def goaway_in(output: bytes) -> tuple[int, bytes] | None:
    """``(error code, debug data)`` of the first GOAWAY frame in ``output``, if any."""
    pos = 0
    while pos + 9 <= len(output):
        length = int.from_bytes(output[pos : pos + 3], "big")
        if output[pos + 3] == 0x7 and length >= 8:
            body = output[pos + 9 : pos + 9 + length]
            return int.from_bytes(body[4:8], "big"), bytes(body[8:])
        pos += 9 + length
    return None


class Engine:
    """The server side of one HTTP/2 connection, within ``limits``."""

    __slots__ = ("_conn",)

    def __init__(self, limits: PeerLimits) -> None:
        self._conn = conn = ngh2.Connection(
            ngh2.Role.SERVER,
            ngh2.Configuration(
                auto_window_update=False,
                max_outbound_ack=limits.max_queued_acks,
                max_settings=limits.max_settings_entries,
                stream_reset_rate_limit=(_UNLIMITED, _UNLIMITED),
                max_continuations=limits.max_continuations,
                glitch_rate_limit=(limits.glitch_burst, limits.glitch_rate),
                max_inbound_header_list_size=limits.max_header_list_size,
                max_inbound_header_count=limits.max_header_fields,
                max_deflate_dynamic_table_size=0,
            ),
        )
        S = ngh2.Setting
        conn.initiate_connection(
            {
                S.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                S.INITIAL_WINDOW_SIZE: limits.stream_window,
                S.MAX_FRAME_SIZE: limits.max_frame_size,
                S.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
                S.ENABLE_PUSH: 0,
            }
        )
        if limits.connection_window > 65_535:
            conn.set_local_window_size(limits.connection_window)

    def receive(self, data: bytes) -> list[Event]:
        """The events ``data`` brings; raises :class:`EngineFailure`."""
        try:
            self._conn.receive_data(data)
        except ngh2.NGH2Error as exc:
            raise _failure(exc) from None
        return self._conn.events()

    def output(self) -> bytes:
        """Everything to write now (b"" when the engine has nothing, or is done)."""
        try:
            return self._conn.data_to_send()
        except ngh2.ConnectionStateError:
            return b""

    @property
    def done(self) -> bool:
        """Neither reading nor writing: the connection is to be closed."""
        try:
            return not (self._conn.want_read or self._conn.want_write)
        except ngh2.ConnectionStateError:
            return True

    def respond(self, stream_id: int, headers: Iterable[Header], end_stream: bool) -> None:
        try:
            self._conn.send_response(stream_id, headers, end_stream=end_stream)
        except ngh2.NGH2Error:
            pass  # the stream was closed meanwhile: nobody to answer

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """Queued in the engine, sent as the peer's windows allow."""
        try:
            self._conn.send_data(stream_id, data, end_stream=end_stream)
        except ngh2.NGH2Error:
            pass

    def send_trailers(self, stream_id: int, headers: Iterable[Header]) -> None:
        try:
            self._conn.send_trailers(stream_id, headers)
        except ngh2.NGH2Error:
            pass

    def reset(self, stream_id: int, code: int) -> None:
        try:
            self._conn.reset_stream(stream_id, code)
        except ngh2.NGH2Error:
            pass

    def consumed(self, stream_id: int, size: int) -> None:
        """``size`` bytes of the stream's data are taken: their window may be returned."""
        try:
            self._conn.acknowledge_received_data(size, stream_id)
        except (ngh2.NGH2Error, ValueError):
            pass  # the stream or connection is gone, and its window with it

    def goaway(self, code: int, debug: bytes = b"") -> None:
        """GOAWAY: no stream after those open now. With NO_ERROR the connection ends when
        they have; with another code the caller closes it once this is written."""
        try:
            self._conn.send_goaway(code, debug_data=debug)
        except ngh2.NGH2Error:
            pass

    def queued(self) -> int:
        """Bytes of DATA queued on all streams, waiting for the peer's windows."""
        try:
            return self._conn.queued_body_size()
        except (ngh2.NGH2Error, ValueError):
            return 0
