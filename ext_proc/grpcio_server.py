"""ext_proc on grpcio's asyncio server: the fallback transport (``--transport grpcio``).

The same :class:`~ext_proc.servicer.ProcessingStream` per stream as on our own
HTTP/2 server, registered as a generic handler on raw bytes (grpcio neither
parses nor serializes), plus grpcio's health service. It costs roughly twice the
CPU a request (see README, Performance) and is kept for an Envoy or network set-up
our HTTP/2 server has not met.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ext_proc.http2.grpc_server import GrpcError
from ext_proc.http2.limits import PeerLimits
from ext_proc.servicer import SERVICE_NAME, ExternalProcessor


class GrpcioExtProcServer:
    """ext_proc and health on grpcio, served like :class:`ext_proc.server.Http2ExtProcServer`."""

    def __init__(self, processor: ExternalProcessor, limits: PeerLimits | None = None) -> None:
        limits = limits or PeerLimits()
        self._server = grpc.aio.server(
            options=[  # the limits grpcio has a knob for; it enforces its own on the rest
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", limits.max_message_bytes),
                ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
                ("grpc.max_connection_idle_ms", int(limits.idle_timeout * 1000)),
                ("grpc.server_handshake_timeout_ms", int(limits.handshake_timeout * 1000)),
                ("grpc.max_allowed_incoming_connections", limits.max_connections),
                ("grpc.http2.max_frame_size", limits.max_frame_size),
                ("grpc.max_metadata_size", limits.max_header_list_size),
                ("grpc.http2.max_pings_without_data", 0),
            ]
        )

        async def process(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            stream = processor.open()
            cancelled = True  # unless the loop ends: a cancellation is Envoy's reset
            try:
                async for message in requests:
                    try:
                        answer = stream.on_message(message)
                    except GrpcError as exc:
                        await context.abort(grpc.StatusCode[exc.code.name], exc.message)
                    if answer is not None and not isinstance(answer, bytes):
                        # shielded: a reset must not cut a reservation in half; the
                        # stream gives the count back when the routing ends
                        answer = await asyncio.shield(answer)
                    if answer is not None:
                        yield answer
                cancelled = False
            finally:
                stream.on_end(cancelled)

        self._server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    SERVICE_NAME, {"Process": grpc.stream_stream_rpc_method_handler(process)}
                )
            ]
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)

    async def start(self, host: str, port: int) -> None:
        if self._server.add_insecure_port(f"{host}:{port}") == 0:
            raise OSError(f"ext_proc cannot bind {host}:{port}")
        await self._server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace=grace)
