"""HTTP/2 frames (RFC 9113 section 4 and 6): the pure codec, no I/O.

A frame is a 9-byte header (24-bit payload length, type, flags, 31-bit stream id)
and its payload. :func:`encode_frame` builds one; :func:`split_frames` cuts every
complete frame off the front of a receive buffer and leaves the rest. The payload
helpers (:func:`strip_padding`, :func:`parse_settings`, ...) check the lengths the
RFC fixes and raise :class:`H2ConnectionError` with the error code the RFC names,
so the connection can answer with a GOAWAY that says what was wrong.

HPACK (RFC 7541) for what we send is here too: :func:`encode_literal_headers`
writes every header as a "literal without indexing", so our side never touches
the peer's dynamic table and a header block is a pure function of its headers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What every HTTP/2 client sends first (RFC 9113 section 3.4)."""

FRAME_HEADER_SIZE = 9
DEFAULT_MAX_FRAME_SIZE = 16_384
DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1


class FrameType(IntEnum):
    DATA = 0x0
    HEADERS = 0x1
    PRIORITY = 0x2
    RST_STREAM = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    PING = 0x6
    GOAWAY = 0x7
    WINDOW_UPDATE = 0x8
    CONTINUATION = 0x9


class Flag:
    END_STREAM = 0x1
    ACK = 0x1
    END_HEADERS = 0x4
    PADDED = 0x8
    PRIORITY = 0x20


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6


class ErrorCode(IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 section 5.4.1): answered by GOAWAY, then close."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class H2StreamError(Exception):
    """A stream error (RFC 9113 section 5.4.2): answered by RST_STREAM on that stream."""

    def __init__(self, stream_id: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.code = code


_HEADER = struct.Struct(">BHBBL")  # 24-bit length as a byte and a short


def encode_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame; ``payload`` must fit the peer's maximum frame size."""
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def split_frames(buffer: bytearray, max_frame_size: int) -> list[tuple[int, int, int, bytes]]:
    """Every complete ``(type, flags, stream id, payload)`` at the front of ``buffer``,
    removed from it; an incomplete frame stays for the next read.

    Raises :class:`H2ConnectionError` (FRAME_SIZE_ERROR) for a frame longer than
    ``max_frame_size``, the limit we advertised.
    """
    frames = []
    pos = 0
    end = len(buffer)
    view = memoryview(buffer)
    try:
        while end - pos >= FRAME_HEADER_SIZE:
            high, low, kind, flags, stream_id = _HEADER.unpack_from(buffer, pos)
            length = (high << 16) | low
            if length > max_frame_size:
                raise H2ConnectionError(
                    ErrorCode.FRAME_SIZE_ERROR,
                    f"frame of {length} bytes exceeds the maximum frame size {max_frame_size}",
                )
            start = pos + FRAME_HEADER_SIZE
            if end - start < length:
                break
            frames.append(
                (kind, flags, stream_id & 0x7FFFFFFF, bytes(view[start : start + length]))
            )
            pos = start + length
    finally:
        view.release()
    if pos:
        del buffer[:pos]
    return frames


def strip_padding(flags: int, payload: bytes) -> bytes:
    """The payload of a DATA or HEADERS frame without its padding (PADDED flag)."""
    if not flags & Flag.PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]


def header_block_fragment(flags: int, payload: bytes) -> bytes:
    """A HEADERS frame's header block fragment: padding and priority fields removed."""
    fragment = strip_padding(flags, payload)
    if flags & Flag.PRIORITY:
        if len(fragment) < 5:
            raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS priority field cut short")
        fragment = fragment[5:]
    return fragment


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    """``(identifier, value)`` pairs of a SETTINGS frame, checked as RFC 9113 6.5.2 says."""
    if len(payload) % 6:
        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
    pairs = [struct.unpack_from(">HL", payload, i) for i in range(0, len(payload), 6)]
    for ident, value in pairs:
        if ident == Setting.ENABLE_PUSH and value > 1:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
        if ident == Setting.INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
        if ident == Setting.MAX_FRAME_SIZE and not DEFAULT_MAX_FRAME_SIZE <= value <= 2**24 - 1:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
    return pairs


def encode_settings(settings: Iterable[tuple[int, int]]) -> bytes:
    return encode_frame(
        FrameType.SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in settings)
    )


def parse_window_increment(payload: bytes) -> int:
    if len(payload) != 4:
        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE must be 4 bytes")
    return int.from_bytes(payload, "big") & 0x7FFFFFFF


def encode_window_update(stream_id: int, increment: int) -> bytes:
    return encode_frame(FrameType.WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def parse_rst_stream(payload: bytes) -> int:
    """The error code of a RST_STREAM frame."""
    if len(payload) != 4:
        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM must be 4 bytes")
    return int.from_bytes(payload, "big")


def parse_goaway(payload: bytes) -> tuple[int, int]:
    """``(last stream id, error code)`` of a GOAWAY frame."""
    if len(payload) < 8:
        raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
    last, code = struct.unpack_from(">LL", payload)
    return last & 0x7FFFFFFF, code


def encode_goaway(last_stream_id: int, code: ErrorCode, message: str = "") -> bytes:
    payload = struct.pack(">LL", last_stream_id, code) + message.encode()[:256]
    return encode_frame(FrameType.GOAWAY, 0, 0, payload)


def encode_rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return encode_frame(FrameType.RST_STREAM, 0, stream_id, struct.pack(">L", code))


# -- HPACK, the sending side -----------------------------------------------------------------


def encode_hpack_integer(value: int, prefix_bits: int, first_byte: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a ``prefix_bits``-bit prefix of ``first_byte``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first_byte | value,))
    out = bytearray((first_byte | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(raw: bytes) -> bytes:
    return encode_hpack_integer(len(raw), 7) + raw  # H bit 0: no Huffman coding


def encode_literal_headers(headers: Iterable[tuple[str, str]]) -> bytes:
    """A header block of "literal header field without indexing, new name" entries."""
    return b"".join(
        b"\x00" + _string(name.encode("latin-1")) + _string(value.encode("latin-1"))
        for name, value in headers
    )


STATUS_200 = b"\x88"
"""``:status: 200``, index 8 of HPACK's static table."""
