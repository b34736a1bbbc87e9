"""ext_proc's own gRPC server, over real sockets, against two independent clients.

grpcio's client (the same C core as most gRPC stacks) checks calls end to end:
ordering, status, big messages both ways through flow control, cancellation,
thousands of concurrent streams and a graceful stop. The h2 library (an
independent HTTP/2 implementation) and hand-made frames check the protocol's
corners: padding, CONTINUATION, a tiny client window, PING, and the errors that
must close a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame

from ext_proc.http2.connection import Http2Connection, ServerContext
from ext_proc.http2.engine import ErrorCode
from ext_proc.http2.grpc_server import (
    Answer,
    GrpcError,
    GrpcServer,
    StatusCode,
    frame_message,
)
from ext_proc.http2.limits import BreachReporter, PeerLimits
from tests.support.h2_frames import PREFACE, grpc_request, parse
from tests.support.h2_frames import frame as encode_frame
from tests.support.wait import async_wait_until

ECHO = "/test.Echo/Stream"
SLOW_FIRST = "/test.Echo/SlowFirst"
HOLD = "/test.Echo/Hold"


@dataclass
class Ends:
    """How each call ended: True for cancelled, False for a normal end."""

    seen: list[bool] = field(default_factory=list)


class Echo:
    def __init__(self, ends: Ends, slow_first: bool = False) -> None:
        self.ends, self.slow_first, self.count = ends, slow_first, 0

    def on_message(self, message: bytes) -> Answer:
        self.count += 1
        if message == b"fail":
            raise GrpcError(StatusCode.INVALID_ARGUMENT, "no thanks: ünïcode 100%")
        if self.slow_first and self.count == 1:
            return self._later(message)
        return message

    async def _later(self, message: bytes) -> bytes:
        await asyncio.sleep(0.05)
        return b"slow:" + message

    def on_end(self, cancelled: bool) -> None:
        self.ends.seen.append(cancelled)


class Hold:
    """Answers nothing; the call stays open until the client ends it."""

    def __init__(self, ends: Ends) -> None:
        self.ends = ends

    def on_message(self, message: bytes) -> Answer:
        return None

    def on_end(self, cancelled: bool) -> None:
        self.ends.seen.append(cancelled)


@pytest.fixture
async def served() -> AsyncIterator[tuple[GrpcServer, Ends]]:
    ends = Ends()
    server = GrpcServer(
        {
            ECHO: lambda: Echo(ends),
            SLOW_FIRST: lambda: Echo(ends, slow_first=True),
            HOLD: lambda: Hold(ends),
        }
    )
    await server.start("127.0.0.1", 0)
    try:
        yield server, ends
    finally:
        await server.stop(grace=1.0)


@contextlib.asynccontextmanager
async def channel(server: GrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.max_receive_message_length", 32 << 20)]
    )
    try:
        yield ch
    finally:
        await ch.close()


def raw_stream(ch: grpc.aio.Channel, path: str) -> grpc.aio.StreamStreamMultiCallable:
    return ch.stream_stream(path, request_serializer=None, response_deserializer=None)


async def call(ch: grpc.aio.Channel, path: str, messages: list[bytes]) -> list[bytes]:
    return [m async for m in raw_stream(ch, path)(iter(messages))]


async def eventually(condition: Callable[[], object], timeout: float = 30.0) -> None:
    await async_wait_until(condition, timeout, "the condition holds")


# -- end to end with grpcio's client ----------------------------------------------------------


async def test_answers_come_in_order_even_when_the_first_is_late(served: tuple) -> None:
    server, ends = served
    async with channel(server) as ch:
        assert await call(ch, ECHO, [b"a", b"", b"c"]) == [b"a", b"", b"c"]
        assert await call(ch, SLOW_FIRST, [b"1", b"2", b"3"]) == [b"slow:1", b"2", b"3"]
    await eventually(lambda: len(ends.seen) == 2)
    assert ends.seen == [False, False]


async def test_unknown_methods_and_handler_errors_end_with_their_status(served: tuple) -> None:
    server, _ = served
    async with channel(server) as ch:
        nope = "/test.Echo/Nope"
        unary = ch.unary_unary(nope, request_serializer=None, response_deserializer=None)
        # refused at once: also a stream that sends nothing (a client still sending when the
        # status comes may report its failed send instead, whoever the server is)
        for attempt in (unary(b"x"), call(ch, nope, [])):
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await attempt
            assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
            assert unknown.value.details() == f"unknown method {nope}"
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call(ch, ECHO, [b"ok", b"fail"])
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert failed.value.details() == "no thanks: ünïcode 100%"


async def test_messages_of_16_mib_pass_both_ways_through_flow_control(served: tuple) -> None:
    server, _ = served
    big = bytes(range(256)) * (16 * 4096)
    async with channel(server) as ch:
        assert await call(ch, ECHO, [big, b"after"]) == [big, b"after"]


async def test_a_cancelled_call_is_ended_as_cancelled(served: tuple) -> None:
    server, ends = served
    async with channel(server) as ch:
        held = raw_stream(ch, HOLD)()
        await held.write(b"hello")
        await eventually(lambda: server.open_calls == 1)
        held.cancel()
        await eventually(lambda: ends.seen == [True])
        await eventually(lambda: server.open_calls == 0)


async def test_three_thousand_concurrent_calls_within_the_stream_limit() -> None:
    ends = Ends()
    server = GrpcServer({HOLD: lambda: Hold(ends)}, PeerLimits(max_concurrent_streams=3000))
    await server.start("127.0.0.1", 0)
    try:
        async with channel(server) as ch:
            held = [raw_stream(ch, HOLD)() for _ in range(3000)]
            for c in held:
                await c.write(b"x")
            await eventually(lambda: server.open_calls == 3000, timeout=20)
            for c in held:
                await c.done_writing()
            for c in held:
                assert await c.code() is grpc.StatusCode.OK
        assert ends.seen.count(False) == 3000
    finally:
        await server.stop(grace=1.0)


async def test_calls_past_the_stream_limit_wait_for_a_free_stream() -> None:
    """MAX_CONCURRENT_STREAMS is advertised: a client holds calls past it until one ends."""
    ends = Ends()
    server = GrpcServer({HOLD: lambda: Hold(ends)}, PeerLimits(max_concurrent_streams=50))
    await server.start("127.0.0.1", 0)
    try:
        release = asyncio.Event()

        async def one(ch: grpc.aio.Channel) -> grpc.StatusCode:
            held = raw_stream(ch, HOLD)()
            await held.write(b"x")  # a call past the limit waits here for a stream
            await release.wait()
            await held.done_writing()
            return await held.code()

        async with channel(server) as ch:
            calls = [asyncio.ensure_future(one(ch)) for _ in range(120)]
            await eventually(lambda: server.open_calls == 50, timeout=20)
            await asyncio.sleep(0.2)  # nothing more gets in while all 50 are held
            assert server.open_calls == 50
            release.set()
            assert await asyncio.gather(*calls) == [grpc.StatusCode.OK] * 120
        assert ends.seen.count(False) == 120
        assert "max_concurrent_streams" not in server.reporter.totals  # it obeyed
    finally:
        await server.stop(grace=1.0)


@contextlib.asynccontextmanager
async def one_held_call() -> AsyncIterator[
    tuple[GrpcServer, Ends, grpc.aio.Channel, grpc.aio.Call]
]:
    """A server of its own (the test stops it) with one call open on it."""
    ends = Ends()
    server = GrpcServer({HOLD: lambda: Hold(ends)})
    await server.start("127.0.0.1", 0)
    try:
        async with channel(server) as ch:
            held = raw_stream(ch, HOLD)()
            await held.write(b"x")
            await eventually(lambda: server.open_calls == 1)
            yield server, ends, ch, held
    finally:
        await server.stop(grace=0)


async def test_a_graceful_stop_lets_open_calls_finish_and_refuses_new_ones() -> None:
    async with one_held_call() as (server, ends, ch, held):
        stopping = asyncio.create_task(server.stop(grace=5.0))
        await asyncio.sleep(0.1)
        assert not stopping.done()  # the open call holds the stop
        await held.done_writing()
        assert await held.code() is grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 30.0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(call(ch, HOLD, [b"x"]), 5.0)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert ends.seen == [False]


async def test_a_stop_cuts_calls_that_outlive_the_grace() -> None:
    async with one_held_call() as (server, ends, _, held):
        await asyncio.wait_for(server.stop(grace=0.2), 3.0)
        assert ends.seen == [True]
        assert await held.code() is grpc.StatusCode.UNAVAILABLE


# -- protocol corners with the h2 library and hand-made frames --------------------------------


class H2Client:
    """A plain HTTP/2 client on the h2 library, over asyncio streams."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int = 65_535
    ) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
        )
        self.conn.initiate_connection()
        self.flush()

    @classmethod
    async def connect(cls, server: GrpcServer, window: int = 65_535) -> H2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        return cls(reader, writer, window)

    def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())

    def request(self, path: str, stream_id: int) -> None:
        self.conn.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "test"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        self.flush()

    async def events(self, until: type, ack_data: bool = True) -> list[h2.events.Event]:
        """Events until one of type ``until`` (flow-control credit given back as data comes)."""
        seen: list[h2.events.Event] = []
        while True:
            data = await asyncio.wait_for(self.reader.read(65_536), 5.0)
            if not data:
                return seen
            for event in self.conn.receive_data(data):
                seen.append(event)
                if isinstance(event, h2.events.DataReceived) and ack_data:
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
            self.flush()
            if any(isinstance(e, until) for e in seen):
                return seen

    def close(self) -> None:
        self.writer.close()


def body_of(events: list[h2.events.Event]) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))


async def test_a_tiny_client_window_gets_the_answer_in_pieces(served: tuple) -> None:
    server, _ = served
    client = await H2Client.connect(server, window=10)
    message = b"m" * 1000
    client.request(ECHO, 1)
    client.conn.send_data(1, frame_message(message), end_stream=True)
    client.flush()
    events = await client.events(until=h2.events.StreamEnded)
    pieces = [e for e in events if isinstance(e, h2.events.DataReceived)]
    assert len(pieces) > 50 and max(len(p.data) for p in pieces) <= 10
    assert body_of(events) == frame_message(message)
    trailers = next(e for e in events if isinstance(e, h2.events.TrailersReceived))
    assert (b"grpc-status", b"0") in trailers.headers
    client.close()


async def test_a_ping_is_answered_with_its_payload(served: tuple) -> None:
    server, _ = served
    client = await H2Client.connect(server)
    client.conn.ping(b"12345678")
    client.flush()
    events = await client.events(until=h2.events.PingAckReceived)
    ack = next(e for e in events if isinstance(e, h2.events.PingAckReceived))
    assert ack.ping_data == b"12345678"
    client.close()


async def test_padded_data_and_a_header_block_in_continuation_frames(served: tuple) -> None:
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    block = hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", ECHO),
            (":authority", "t"),
            ("content-type", "application/grpc"),
            ("x-filler", "f" * 3000),
        ]
    )
    headers = HeadersFrame(1, block[:1000])
    continued = ContinuationFrame(1, block[1000:2000])
    last = ContinuationFrame(1, block[2000:], flags=["END_HEADERS"])
    data = DataFrame(1, frame_message(b"padded"), flags=["PADDED", "END_STREAM"])
    data.pad_length = 40
    writer.write(
        PREFACE
        + encode_frame(4, 0, 0)
        + b"".join(f.serialize() for f in (headers, continued, last, data))
    )
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()  # the state machine only: what it would send is dropped
    client.data_to_send()
    client.send_headers(
        1,
        [(":method", "POST"), (":path", ECHO), (":scheme", "http"), (":authority", "t")],
        end_stream=True,
    )
    client.data_to_send()
    seen: list[h2.events.Event] = []
    while not any(isinstance(e, h2.events.StreamEnded) for e in seen):
        data = await asyncio.wait_for(reader.read(65_536), 5.0)
        assert data, "the server closed the connection before the stream ended"
        seen += client.receive_data(data)
    assert body_of(seen) == frame_message(b"padded")
    writer.close()


async def goaway_for(server: GrpcServer, frames: bytes) -> int:
    """The error code of the GOAWAY the server answers ``frames`` with; it then closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(frames)
    received = b""
    while True:
        chunk = await asyncio.wait_for(reader.read(65_536), 5.0)
        if not chunk:
            break
        received += chunk
    writer.close()
    pos = 0
    while pos + 9 <= len(received):
        length = int.from_bytes(received[pos : pos + 3], "big")
        if received[pos + 3] == 7:  # GOAWAY
            return int.from_bytes(received[pos + 13 : pos + 17], "big")
        pos += 9 + length
    raise AssertionError("no GOAWAY before the connection closed")


async def test_a_connection_that_is_not_http2_is_refused(served: tuple) -> None:
    server, _ = served
    code = await goaway_for(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == ErrorCode.PROTOCOL_ERROR


async def test_data_on_a_stream_never_opened_closes_the_connection(served: tuple) -> None:
    server, _ = served
    code = await goaway_for(server, PREFACE + encode_frame(4, 0, 0) + encode_frame(0, 0, 9, b"x"))
    assert code == ErrorCode.PROTOCOL_ERROR


async def test_a_stream_id_that_goes_backwards_opens_nothing(served: tuple) -> None:
    """RFC 9113 5.1.1 makes it a connection error; libnghttp2 ignores the frame (a
    "glitch", counted towards the useless-frame limit): no call is opened either way."""
    server, ends = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    encoder = hpack.Encoder()
    request = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", ECHO),
        (":authority", "t"),
        ("content-type", "application/grpc"),
    ]
    opens = b"".join(encode_frame(1, 0x4 | 0x1, sid, encoder.encode(request)) for sid in (5, 3))
    writer.write(PREFACE + encode_frame(4, 0, 0) + opens + encode_frame(6, 0, 0, b"12345678"))
    received = b""
    while not any(k == 6 and f & 1 for k, f, _, _ in parse(received)):  # until the PING ACK
        data = await asyncio.wait_for(reader.read(65_536), 5.0)
        assert data, "the server closed the connection before its PING ACK"
        received += data
    answered = {sid for k, _, sid, _ in parse(received) if k == 1}
    assert answered == {5}
    writer.close()
    await eventually(lambda: ends.seen == [False])


async def test_a_header_block_that_does_not_decode_is_a_compression_error(served: tuple) -> None:
    server, _ = served
    frames = PREFACE + encode_frame(4, 0, 0) + encode_frame(1, 0x4, 1, b"\xff\xff\xff\xff")
    code = await goaway_for(server, frames)
    assert code == ErrorCode.COMPRESSION_ERROR
    assert server.reporter.totals == {"protocol_error": 1}


async def test_a_client_that_floods_pings_and_never_reads_is_cut_off(served: tuple) -> None:
    """More unanswered PINGs than the queued-acknowledgement limit end the connection."""
    server, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(PREFACE + encode_frame(4, 0, 0))
    pings = encode_frame(6, 0, 0, b"12345678") * 1000
    for _ in range(400):  # 6.8 MB of PINGs: as many bytes of ACKs, never read
        writer.write(pings)
    await eventually(lambda: server.connections == 0, timeout=10)
    assert server.reporter.totals.get("max_queued_acks", 0) == 1
    writer.close()


# -- limits --------------------------------------------------------------------------------


class Gated:
    """Answers each message once ``gate`` is set."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    def on_message(self, message: bytes) -> Answer:
        return self._later(message)

    async def _later(self, message: bytes) -> bytes:
        await self.gate.wait()
        return message[:4]

    def on_end(self, cancelled: bool) -> None:
        pass


async def raw_peer(server: GrpcServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(PREFACE + encode_frame(4, 0, 0) + encode_frame(4, 1, 0))
    return reader, writer


async def zero_window_call(server: GrpcServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A peer whose window for our answers is 0, with a call open on stream 1."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    initial_window_0 = b"\x00\x04" + (0).to_bytes(4, "big")
    writer.write(PREFACE + encode_frame(4, 0, 0, initial_window_0) + encode_frame(4, 1, 0))
    writer.write(encode_frame(1, 0x4, 1, grpc_request(ECHO.encode())))
    return reader, writer


class Counting(Echo):
    """Echoes each message at once, noting its size in ``answered``."""

    def __init__(self, ends: Ends, answered: list[int]) -> None:
        super().__init__(ends)
        self.answered = answered

    def on_message(self, message: bytes) -> Answer:
        self.answered.append(len(message))
        return message


async def test_a_stream_whose_answer_waits_gets_no_window_back() -> None:
    """Messages queued behind a pending answer hold their window: the peer cannot send
    more than its window of work; when the answers come, the window comes back."""
    gate = asyncio.Event()
    window = 65_535
    server = GrpcServer({ECHO: lambda: Gated(gate)}, PeerLimits(stream_window=window))
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await raw_peer(server)
        message = frame_message(b"m" * 1000)
        writer.write(encode_frame(1, 0x4, 1, grpc_request(ECHO.encode())))
        writer.write(b"".join(encode_frame(0, 0, 1, message) for _ in range(60)))  # < window
        received = b""

        async def read_for(seconds: float) -> None:
            nonlocal received
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    while chunk := await reader.read(65_536):
                        received += chunk

        await read_for(0.5)
        updates = [f for f in parse(received) if f[0] == 8 and f[2] == 1]
        assert updates == []  # 60 KB queued behind the first answer: no window back
        gate.set()
        await read_for(0.5)
        updates = [f for f in parse(received) if f[0] == 8 and f[2] == 1]
        assert sum(int.from_bytes(p, "big") for *_, p in updates) >= 30_000
        writer.close()
    finally:
        await server.stop(grace=0.5)


async def test_unfinished_messages_are_held_within_both_budgets() -> None:
    limits = PeerLimits(
        max_message_bytes=64 * 1024,
        connection_partial_bytes=64 * 1024,
        process_partial_bytes=96 * 1024,
    )
    server = GrpcServer({ECHO: lambda: Echo(Ends())}, limits)
    await server.start("127.0.0.1", 0)
    try:
        peers = [await raw_peer(server) for _ in range(3)]
        piece = b"\x00" + (60_000).to_bytes(4, "big") + b"x" * 30_000  # half a message
        for _, writer in peers:
            for sid in (1, 3, 5):
                writer.write(encode_frame(1, 0x4, sid, grpc_request(ECHO.encode())))
                writer.write(encode_frame(0, 0, sid, piece[:16_000]))
                writer.write(encode_frame(0, 0, sid, piece[16_000:]))
        await eventually(
            lambda: sum(server.reporter.totals.values()) >= 4 and server.partial_bytes > 0
        )
        assert server.partial_bytes <= limits.process_partial_bytes
        assert set(server.reporter.totals) <= {"connection_partial_bytes", "process_partial_bytes"}
        assert server.reporter.totals.get("process_partial_bytes", 0) >= 1
        for _, writer in peers:
            writer.close()
        await eventually(lambda: server.partial_bytes == 0 and server.connections == 0, 10)
    finally:
        await server.stop(grace=0.5)


async def test_a_peer_that_reads_nothing_is_disconnected_after_the_write_stall_timeout() -> None:
    ends = Ends()
    limits = PeerLimits(write_stall_timeout=1.0, max_message_bytes=32 << 20)
    server = GrpcServer({ECHO: lambda: Echo(ends)}, limits)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await raw_peer(server)  # windows open wide: we may send it all
        writer.write(encode_frame(4, 0, 0, b"\x00\x04\x7f\xff\xff\xff"))
        writer.write(encode_frame(8, 0, 0, (2**31 - 65_536).to_bytes(4, "big")))
        big = frame_message(b"e" * (16 << 20))  # echoed: far more than the sockets hold
        writer.write(encode_frame(1, 0x4, 1, grpc_request(ECHO.encode())))
        for start in range(0, len(big), 16_384):
            writer.write(encode_frame(0, 0, 1, big[start : start + 16_384]))
        await writer.drain()  # and then never read
        await eventually(lambda: server.connections == 0, timeout=30)
        assert server.reporter.totals == {"write_stall_timeout": 1}
        assert ends.seen == [True]
        writer.close()
    finally:
        await server.stop(grace=0.5)


async def test_a_peer_that_never_opens_its_window_is_disconnected_too() -> None:
    """Answers wait in the engine for the peer's window: past max_queued_output, the peer
    has the write-stall timeout to open it."""
    ends = Ends()
    limits = PeerLimits(write_stall_timeout=1.0, max_queued_output=256 * 1024)
    server = GrpcServer({ECHO: lambda: Echo(ends)}, limits)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await raw_peer(server)  # its windows stay at 65,535 bytes
        big = frame_message(b"e" * (1 << 20))
        writer.write(encode_frame(1, 0x4, 1, grpc_request(ECHO.encode())))
        for start in range(0, len(big), 16_384):
            writer.write(encode_frame(0, 0, 1, big[start : start + 16_384]))
        received = b""
        while chunk := await asyncio.wait_for(reader.read(65_536), 30):
            received += chunk  # read all it sends: its socket never fills
        assert server.reporter.totals == {"write_stall_timeout": 1}
        assert ends.seen == [True]
        writer.close()
    finally:
        await server.stop(grace=0.5)


async def test_a_peer_that_asks_without_opening_its_window_gets_no_more_answers_queued() -> None:
    """Its window for our answers at 0, a peer sends message after message (tiny ones, each
    answered at once): past max_queued_output of answers waiting, the server answers no
    more and holds the messages with their window, so what it holds is bounded by the
    windows it gave, not by how long the peer goes on; the stall timeout ends it."""
    ends = Ends()
    answered: list[int] = []

    limits = PeerLimits(write_stall_timeout=1.0, max_queued_output=64 * 1024, stream_window=4 << 20)
    server = GrpcServer({ECHO: lambda: Counting(ends, answered)}, limits)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await zero_window_call(server)
        message = frame_message(b"q" * 1000)
        for _ in range(2_000):  # 2 MB of questions, within the windows we gave
            writer.write(encode_frame(0, 0, 1, message))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        async with asyncio.timeout(30):
            while await reader.read(65_536):  # read it all: only the windows hold it
                pass
        assert len(answered) < 300, len(answered)  # 64 KB of answers and one read's worth
        assert server.reporter.totals == {"write_stall_timeout": 1}
        assert ends.seen == [True]
        writer.close()
    finally:
        await server.stop(grace=0.5)


async def test_answers_held_for_the_peers_window_go_out_once_it_opens() -> None:
    """The same backlog, with a peer that opens its window later: every message is
    answered, in order, and the call ends OK."""
    limits = PeerLimits(max_queued_output=16 * 1024)
    server = GrpcServer({ECHO: lambda: Echo(Ends())}, limits)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await zero_window_call(server)
        messages = [frame_message(b"%04d" % n + b"." * 996) for n in range(100)]
        for n, message in enumerate(messages):
            writer.write(encode_frame(0, 0x1 if n == 99 else 0, 1, message))
        await writer.drain()
        await asyncio.sleep(0.3)  # the backlog forms
        writer.write(encode_frame(4, 0, 0, b"\x00\x04" + (1 << 20).to_bytes(4, "big")))
        writer.write(encode_frame(8, 0, 0, (1 << 20).to_bytes(4, "big")))  # the connection's
        received = b""
        async with asyncio.timeout(30):
            while b"grpc-status" not in received and (chunk := await reader.read(65_536)):
                received += chunk
                if any(f[0] == 1 and f[1] & 0x1 for f in parse(received)):  # trailers
                    break
        data = b"".join(p for kind, _, sid, p in parse(received) if kind == 0 and sid == 1)
        assert data == b"".join(messages)
        writer.close()
    finally:
        await server.stop(grace=0.5)


@pytest.mark.parametrize("size", [2_000, 200_000])  # in one DATA frame, and in many
async def test_a_message_over_the_size_limit_is_refused(size: int) -> None:
    server = GrpcServer({ECHO: lambda: Echo(Ends())}, PeerLimits(max_message_bytes=1_000))
    await server.start("127.0.0.1", 0)
    try:
        async with channel(server) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(ch, ECHO, [b"x" * size])
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await call(ch, ECHO, [b"small"]) == [b"small"]
    finally:
        await server.stop(grace=0.5)


async def read_frames(reader: asyncio.StreamReader, until: Callable[[list], bool]) -> list:
    received = b""
    async with asyncio.timeout(10):
        while not until(parse(received)):
            chunk = await reader.read(65_536)
            if not chunk:
                break
            received += chunk
    return parse(received)


async def test_a_request_that_ends_inside_a_message_is_an_internal_error(served: tuple) -> None:
    """gRPC's rule: the client's END_STREAM in the middle of a length-prefixed message is
    an error (INTERNAL), not a call that ended well."""
    server, _ = served
    reader, writer = await raw_peer(server)
    writer.write(encode_frame(1, 0x4, 1, grpc_request(ECHO.encode())))
    writer.write(encode_frame(0, 0x1, 1, frame_message(b"0123456789a")[:9]))  # 9 bytes of 16
    frames = await read_frames(reader, lambda fs: any(f[0] == 1 and f[1] & 0x1 for f in fs))
    [block] = [payload for kind, flags, sid, payload in frames if kind == 1 and sid == 1]
    headers = dict(hpack.Decoder().decode(block))
    assert headers["grpc-status"] == str(StatusCode.INTERNAL.value)
    await eventually(lambda: server.partial_bytes == 0)
    writer.close()


async def test_answers_ready_after_the_connection_failed_are_dropped_quietly() -> None:
    """A reset burst ends the connection while calls still wait on their answers: when
    those come, nothing is written after the connection's end, no task fails, and the
    server still stops gracefully."""
    loop = asyncio.get_running_loop()
    errors: list[object] = []
    loop.set_exception_handler(lambda _, context: errors.append(context.get("exception")))
    gate = asyncio.Event()
    server = GrpcServer({ECHO: lambda: Gated(gate)}, PeerLimits(reset_burst=1, reset_rate=0.01))
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await raw_peer(server)
        for sid in (1, 3, 5):
            writer.write(encode_frame(1, 0x4, sid, grpc_request(ECHO.encode())))
            writer.write(encode_frame(0, 0, sid, frame_message(b"ask")))
        for sid in (1, 3):  # two resets of calls still open: past the burst of one
            writer.write(encode_frame(3, 0, sid, (8).to_bytes(4, "big")))
        await eventually(lambda: server.reporter.totals.get("reset_burst") == 1)
        gate.set()  # stream 5's answer comes, after the connection's end
        await asyncio.sleep(0.2)
        writer.close()
    finally:
        await server.stop(grace=0.5)
        loop.set_exception_handler(None)
    assert errors == []


async def test_a_connection_evicted_before_it_is_made_closes_once_it_is() -> None:
    """On plain asyncio a burst of accepts builds every protocol before any is made: one
    evicted meanwhile (its transport not there yet) must close when it arrives, not
    live on untracked."""

    class Transport:
        aborted = False

        def get_extra_info(self, name: str) -> object:
            return ("192.0.2.1", 40000) if name == "peername" else None

        def abort(self) -> None:
            self.aborted = True

        def write(self, data: bytes) -> None:
            raise AssertionError("nothing is written to an evicted connection")

    conn = Http2Connection(ServerContext(Echo, PeerLimits(), BreachReporter()))
    conn.abort()
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    assert transport.aborted


async def test_a_stream_that_never_sends_its_first_message_is_reset() -> None:
    """A stream opened and left silent would hold its slot (and, once routed, an
    instance's in-flight count) for good: Envoy sends its first message at once, so a
    stream without one after first_message_timeout is reset."""
    ends = Ends()
    server = GrpcServer({ECHO: lambda: Echo(ends)}, PeerLimits(first_message_timeout=0.5))
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await raw_peer(server)
        writer.write(encode_frame(1, 0x4, 1, grpc_request(ECHO.encode())))  # and nothing more
        writer.write(encode_frame(1, 0x4, 3, grpc_request(ECHO.encode())))
        writer.write(encode_frame(0, 0, 3, frame_message(b"here")))  # this one speaks
        frames = await read_frames(reader, lambda fs: any(f[0] == 3 for f in fs))
        assert [(sid, int.from_bytes(p, "big")) for kind, _, sid, p in frames if kind == 3] == [
            (1, ErrorCode.CANCEL)
        ]
        assert server.reporter.totals == {"first_message_timeout": 1}
        assert ends.seen == [True]
        writer.close()
    finally:
        await server.stop(grace=0.5)


async def test_at_the_connection_cap_an_idle_connection_makes_room() -> None:
    """Every connection handshaken, none with a call open: a new peer (a restarted Envoy)
    gets in by closing the oldest idle one, where it used to be refused."""
    server = GrpcServer({ECHO: lambda: Echo(Ends())}, PeerLimits(max_connections=2))
    await server.start("127.0.0.1", 0)
    try:
        idle = [await raw_peer(server) for _ in range(2)]
        await eventually(lambda: server.connections == 2)
        await asyncio.sleep(0.1)  # both handshaken
        async with channel(server) as ch:
            assert await call(ch, ECHO, [b"in"]) == [b"in"]
        async with asyncio.timeout(5):
            while await idle[0][0].read(65_536):  # the oldest: closed
                pass
        assert server.reporter.totals == {"max_connections": 1}
        for _, writer in idle:
            writer.close()
    finally:
        await server.stop(grace=0.5)


async def test_calls_past_the_process_cap_are_refused_and_the_count_given_back() -> None:
    """Every open stream holds a call's state: past max_open_calls on all connections a
    new one is refused (REFUSED_STREAM; Envoy goes on unrouted), and each stream that
    ends, however it ends, gives its place back."""
    ends = Ends()
    server = GrpcServer({HOLD: lambda: Hold(ends)}, PeerLimits(max_open_calls=2))
    await server.start("127.0.0.1", 0)
    try:
        first, second = await raw_peer(server), await raw_peer(server)
        for _, writer in (first, second):
            writer.write(encode_frame(1, 0x4, 1, grpc_request(HOLD.encode())))
        await eventually(lambda: server._context.open_calls == 2)
        first[1].write(encode_frame(1, 0x4, 3, grpc_request(HOLD.encode())))
        frames = await read_frames(first[0], lambda fs: any(f[0] == 3 for f in fs))
        resets = [(sid, int.from_bytes(p, "big")) for kind, _, sid, p in frames if kind == 3]
        assert resets == [(3, ErrorCode.REFUSED_STREAM)]
        assert server.reporter.totals == {"max_open_calls": 1}
        first[1].write(encode_frame(3, 0, 1, (8).to_bytes(4, "big")))  # the client cancels one
        second[1].close()  # and a connection goes
        await eventually(lambda: server._context.open_calls == 0)
        first[1].write(encode_frame(1, 0x4, 5, grpc_request(HOLD.encode())))
        await eventually(lambda: server._context.open_calls == 1)
        first[1].close()
    finally:
        await server.stop(grace=0.5)


async def test_after_a_backlog_the_held_messages_are_answered_only_while_there_is_room() -> None:
    """The peer opens its window a little: the server answers held messages until its
    answers are over max_queued_output again, and holds the rest, not all of them at once."""
    answered: list[int] = []

    limits = PeerLimits(max_queued_output=16_000)
    server = GrpcServer({ECHO: lambda: Counting(Ends(), answered)}, limits)
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await zero_window_call(server)
        for _ in range(100):
            writer.write(encode_frame(0, 0, 1, frame_message(b"q" * 1000)))
        await writer.drain()
        await eventually(lambda: len(answered) > 0)
        await asyncio.sleep(0.2)  # the backlog formed: the rest are held
        held_at = len(answered)
        assert held_at < 100
        writer.write(encode_frame(8, 0, 1, (20_000).to_bytes(4, "big")))  # a little room
        writer.write(encode_frame(8, 0, 0, (20_000).to_bytes(4, "big")))
        await writer.drain()
        await eventually(lambda: len(answered) > held_at)
        await asyncio.sleep(0.2)
        assert len(answered) < 100, len(answered)  # not every held message at once
        writer.close()
    finally:
        await server.stop(grace=0.5)
