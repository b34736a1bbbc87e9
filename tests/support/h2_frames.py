"""Hand-made HTTP/2 frames for protocol tests: what a misbehaving peer sends."""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def settings(*pairs: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in pairs))


def parse(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """Every complete ``(type, flags, stream id, payload)`` in ``data``."""
    frames, pos = [], 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        if pos + 9 + length > len(data):
            break
        kind, flags = data[pos + 3], data[pos + 4]
        stream_id = int.from_bytes(data[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        frames.append((kind, flags, stream_id, data[pos + 9 : pos + 9 + length]))
        pos += 9 + length
    return frames


def goaway_code(data: bytes) -> int | None:
    """The error code of the first GOAWAY in ``data``, if any."""
    for kind, _, _, payload in parse(data):
        if kind == GOAWAY:
            return int.from_bytes(payload[4:8], "big")
    return None


def literal_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HPACK header block of literals without indexing (names and values < 127 bytes):
    it never touches the decoder's dynamic table, so it can be sent any number of times."""
    return b"".join(
        b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value for name, value in headers
    )


def grpc_request(path: bytes) -> bytes:
    """The header block of a gRPC call to ``path``."""
    return literal_block(
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", b"ext-proc"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
    )
