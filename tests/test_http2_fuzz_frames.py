"""Frame-level fuzzing of ext_proc's HTTP/2 connection (hypothesis).

Random sequences of frames of every type (valid gRPC calls among them, with bodies
that fit, straddle or break the budgets; bad header blocks; frames on wrong streams;
floods), cut into random reads, are fed to one :class:`Http2Connection` over a fake
transport. Whatever comes, the connection handler never raises (nor does any callback
it schedules), every feed returns (a generous deadline), the partial-message budgets
are never exceeded, and once the connection is gone every call has ended and every
budgeted byte is given back.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc.http2.connection import Http2Connection, ServerContext
from ext_proc.http2.grpc_server import Answer, GrpcServer
from ext_proc.http2.limits import BreachReporter, PeerLimits
from tests.support.h2_frames import PREFACE, frame, grpc_request, literal_block

LIMITS = PeerLimits(
    max_concurrent_streams=8,
    stream_window=64 * 1024,
    connection_window=256 * 1024,
    max_frame_size=16_384,
    max_message_bytes=32 * 1024,
    connection_partial_bytes=40 * 1024,
    process_partial_bytes=64 * 1024,
    reset_burst=20,
    reset_rate=1.0,
    max_continuations=4,
    glitch_burst=50,
    glitch_rate=1,
)


class Calls:
    def __init__(self) -> None:
        self.opened = 0
        self.ended = 0


class Handler:
    def __init__(self, calls: Calls, slow: bool) -> None:
        self.calls, self.slow = calls, slow
        calls.opened += 1

    def on_message(self, message: bytes) -> Answer:
        return self._later(message) if self.slow else message[:64]

    async def _later(self, message: bytes) -> bytes:
        await asyncio.sleep(0)
        return message[:64]

    def on_end(self, cancelled: bool) -> None:
        self.calls.ended += 1


class FakeTransport:
    def __init__(self) -> None:
        self.written = 0
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def close(self) -> None:
        self.closed = True

    abort = close

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


PATHS = [b"/fuzz/Echo", b"/fuzz/Slow", b"/nope"]
stream_ids = st.sampled_from([1, 3, 5, 7, 9, 11, 13, 15, 17, 0, 2, 101])
flags = st.integers(0, 255)


def grpc_message(size: int, declared: int | None = None) -> bytes:
    return b"\x00" + struct.pack(">L", size if declared is None else declared) + b"m" * size


payloads = st.one_of(
    st.integers(0, 300).map(grpc_message),
    st.integers(0, 30_000).map(grpc_message),
    st.binary(max_size=64),
    st.tuples(st.integers(0, 2_000), st.integers(0, 2**32 - 1)).map(lambda t: grpc_message(*t)),
)
header_blocks = st.one_of(
    st.sampled_from(PATHS).map(grpc_request),
    st.binary(max_size=40),
    st.just(literal_block([(b":method", b"GET"), (b":path", b"/")])),
)
frames = st.one_of(
    st.builds(lambda s, f, b: frame(1, f, s, b), stream_ids, flags, header_blocks),
    st.builds(lambda s, f, p: frame(0, f & 0x1, s, p[:16_384]), stream_ids, flags, payloads),
    st.builds(lambda s, f, b: frame(9, f, s, b), stream_ids, flags, st.binary(max_size=20)),
    st.builds(lambda s, c: frame(3, 0, s, struct.pack(">L", c)), stream_ids, st.integers(0, 14)),
    st.builds(lambda f, b: frame(4, f & 1, 0, b), flags, st.binary(max_size=36)),
    st.builds(lambda f: frame(6, f & 1, 0, b"12345678"), flags),
    st.builds(lambda s, n: frame(8, 0, s, struct.pack(">L", n)), stream_ids, st.integers(0, 2**31)),
    st.builds(lambda b: frame(7, 0, 0, b), st.binary(min_size=8, max_size=16)),
    st.builds(lambda t, s, b: frame(t, 0, s, b), st.integers(2, 255), stream_ids, st.binary()),
    st.builds(lambda n: frame(9, 0, 1) * n, st.integers(0, 30)),  # empty CONTINUATIONs
    st.builds(lambda n: frame(0, 0, 1) * n, st.integers(0, 80)),  # empty DATA
)
calls = st.builds(
    lambda path, messages, end: ("call", path, messages, end),
    st.sampled_from(PATHS),
    st.lists(payloads, max_size=3),
    st.booleans(),
)
"""A call on the next stream id: its request, messages (whole, cut, oversized), maybe END_STREAM."""
more = st.builds(
    lambda back, payload, end: ("more", back, payload, end),
    st.integers(1, 4),
    payloads,
    st.booleans(),
)
"""DATA on the stream of an earlier call (``back`` calls ago)."""
resets = st.builds(lambda back: ("reset", back), st.integers(1, 4))
raw = frames.map(lambda f: ("raw", f))
steps = st.integers(0, 9).flatmap(  # weighted: one_of would flatten the raw frames' branches
    lambda i: calls if i < 5 else more if i < 7 else resets if i < 8 else raw
)
openings = st.integers(0, 9).flatmap(
    lambda i: (
        st.just(PREFACE + frame(4, 0, 0) + frame(4, 1, 0))
        if i < 8
        else st.sampled_from([PREFACE + frame(4, 0, 0), PREFACE, b"", PREFACE[:10]])
    )
)


def wire(steps: list[tuple[Any, ...]]) -> bytes:
    out, sids = [], []
    for step in steps:
        if step[0] == "raw":
            out.append(step[1])
        elif step[0] == "call":
            _, path, messages, end = step
            sid = 2 * len(sids) + 1
            sids.append(sid)
            out.append(
                frame(1, 0x4 | (0x1 if end and not messages else 0), sid, grpc_request(path))
            )
            for i, message in enumerate(messages):
                last = end and i == len(messages) - 1
                out.append(frame(0, 0x1 if last else 0, sid, message[:16_384]))
        elif sids:
            sid = sids[-min(step[1], len(sids))]
            if step[0] == "more":
                out.append(frame(0, 0x1 if step[3] else 0, sid, step[2][:16_384]))
            else:
                out.append(frame(3, 0, sid, struct.pack(">L", 8)))
    return b"".join(out)


async def drive(opening: bytes, sequence: list[tuple[Any, ...]], cuts: list[int]) -> None:
    calls = Calls()
    server = GrpcServer(
        {
            "/fuzz/Echo": lambda: Handler(calls, slow=False),
            "/fuzz/Slow": lambda: Handler(calls, slow=True),
        },
        LIMITS,
    )
    context = ServerContext(server._open_call, LIMITS, BreachReporter())
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, ctx: errors.append(ctx))
    conn = Http2Connection(context)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    data = opening + wire(sequence)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    for start, end in zip(points, points[1:], strict=False):
        conn.data_received(data[start:end])
        assert context.budget.used <= LIMITS.process_partial_bytes
        assert conn.partial_bytes <= LIMITS.connection_partial_bytes
        for _ in range(3):  # answers that wait a loop turn
            await asyncio.sleep(0)
        if transport.closed:
            break
    conn.tick(loop.time() + 3600)  # every timer expires
    conn.connection_lost(None)
    for _ in range(3):
        await asyncio.sleep(0)
    assert not errors, errors
    assert context.budget.used == 0
    assert context.open_calls == 0
    assert calls.ended == calls.opened


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    opening=openings,
    sequence=st.lists(steps, min_size=1, max_size=30),
    cuts=st.lists(st.integers(0, 2**20), max_size=8),
)
def test_any_frame_sequence_is_survived_within_the_budgets(
    opening: bytes, sequence: list[tuple[Any, ...]], cuts: list[int]
) -> None:
    asyncio.run(asyncio.wait_for(drive(opening, sequence, cuts), 30.0))
