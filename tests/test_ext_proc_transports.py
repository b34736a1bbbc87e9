"""Both ext_proc transports serve the same thing: ext_proc's method and gRPC health.

Each server runs in this process on a free port and is driven by grpcio's client:
a stream routed as Envoy's would be, a message that is not a ProcessingRequest,
and the health service following ``set_serving``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ext_proc.grpcio_server import GrpcioExtProcServer
from ext_proc.http2.limits import PeerLimits
from ext_proc.router import RequestRouter
from ext_proc.server import ExtProcServer, Http2ExtProcServer
from ext_proc.servicer import PROCESS_PATH, SERVICE_NAME, ExternalProcessor
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.table import RoutingTable
from prefix_router.ops.procs import cli_command, free_port
from prefix_router.state.routing import InProcessStore
from tests.conftest import REDIS_URL


@pytest.fixture(params=[Http2ExtProcServer, GrpcioExtProcServer])
async def served(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[grpc.aio.Channel, ExtProcServer, ExternalProcessor]]:
    table = RoutingTable.build(
        Fleet.of([Instance("127.0.0.1", 8000 + i) for i in range(3)]), RouterConfig()
    )
    processor = ExternalProcessor(RequestRouter(table, InProcessStore()))
    server: ExtProcServer = request.param(processor)
    port = free_port()
    await server.start("127.0.0.1", port)
    await server.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, server, processor
    finally:
        await channel.close()
        await server.stop(grace=0.5)


def process(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    return channel.stream_stream(PROCESS_PATH, request_serializer=None, response_deserializer=None)


async def test_a_stream_is_routed_and_its_session_ends_with_it(served: tuple) -> None:
    channel, _, processor = served
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]
        )
    )
    body = pb.HttpBody(body=b'{"model": "m", "prompt": "hello"}', end_of_stream=True)
    messages = [
        pb.ProcessingRequest(request_headers=headers).SerializeToString(),
        pb.ProcessingRequest(request_body=body).SerializeToString(),
    ]
    answers = [pb.ProcessingResponse.FromString(a) async for a in process(channel)(messages)]
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    mutation = answers[1].request_body.response.header_mutation.set_headers
    assert [h.header.key for h in mutation] == ["x-prefix-key"]
    assert processor.open_streams == 0
    assert await processor.router.store.in_flight() == {}


async def test_a_message_that_is_not_a_processing_request_is_refused(served: tuple) -> None:
    channel, _, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [a async for a in process(channel)([b"\xff\xff\xff"])]
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_health_follows_set_serving(served: tuple) -> None:
    channel, server, _ = served
    health = health_pb2_grpc.HealthStub(channel)
    for serving, expected in ((True, "SERVING"), (False, "NOT_SERVING")):
        await server.set_serving(serving)
        for service in ("", SERVICE_NAME):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status) == expected


@pytest.mark.parametrize("transport", [Http2ExtProcServer, GrpcioExtProcServer])
async def test_connections_past_the_cap_are_closed_at_once(transport: type) -> None:
    """``--h2-max-connections`` holds on both transports (grpcio's own knob on its): ours
    makes room by closing the oldest connection with no call open (an Envoy's idle one
    reconnects), grpcio closes the new one."""
    table = RoutingTable.build(Fleet.of([Instance("127.0.0.1", 8000)]), RouterConfig())
    processor = ExternalProcessor(RequestRouter(table, InProcessStore()))
    server: ExtProcServer = transport(processor, PeerLimits(max_connections=3))
    port = free_port()
    await server.start("127.0.0.1", port)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

    def closed_at_once() -> bool:
        """Whether the server closes a new connection within a second (ours says GOAWAY
        first, grpcio just closes it)."""
        s = socket.create_connection(("127.0.0.1", port), timeout=1)
        held.append(s)
        s.sendall(preface)
        return closed_at_once_on(s)

    held: list[socket.socket] = []
    try:
        closed = [await asyncio.to_thread(closed_at_once) for _ in range(4)]
        oldest_closed = await asyncio.to_thread(closed_at_once_on, held[0])
    finally:
        for s in held:
            s.close()
        await server.stop(grace=0.5)
    if transport is Http2ExtProcServer:
        assert (closed, oldest_closed) == ([False, False, False, False], True)
    else:
        assert (closed, oldest_closed) == ([False, False, False, True], False)


def closed_at_once_on(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (or does within a second)."""
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_ext_proc_exits_when_its_port_is_taken_while_it_follows_redis() -> None:
    """With no static fleet ext_proc follows the control plane's state in Redis; a server
    that cannot start must still end the process (so a restart policy can act), not leave
    it waiting on the follower for good."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ran = subprocess.run(
            cli_command(
                "ext-proc", "--host", "127.0.0.1", "--port", str(port), "--redis-url", REDIS_URL
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert ran.returncode != 0
    assert "in use" in ran.stderr, ran.stderr[-2000:]
