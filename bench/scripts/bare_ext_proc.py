"""A bare Python ext_proc: it answers every message with "continue" and decides nothing.

The yardstick for ``data_plane_latency.py``: grpc.aio and the xds-protos messages, the
same two messages per request as prefix-router's ext_proc, none of its work (no key,
no ring, no counts, no header). What prefix-router adds on top of it is what its own
logic costs; what it adds on top of Envoy alone is what a Python ext_proc costs at all.

    python bench/scripts/bare_ext_proc.py PORT
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

CONTINUE = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
}


class Bare(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(  # noqa: N802 - the gRPC method name
        self, requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        async for message in requests:
            answer = CONTINUE.get(message.WhichOneof("request"))
            if answer is not None:
                yield answer


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Bare(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
