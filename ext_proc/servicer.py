"""Envoy External Processing (ext_proc) servicer: the gRPC shell around the router.

Envoy runs the ext_proc filter with ``request_header_mode: SEND``,
``request_body_mode: BUFFERED`` and nothing else; one gRPC stream carries one
HTTP request, in two messages:

1. request headers -> remember ``:path`` and the tenant header; continue.
   (A header set here would be dropped by Envoy 1.40 in the body phase unless
   headers are SENT, which is why they are.)
2. request body (the whole body, up to the 64 MiB limit) -> route it and set
   ``x-prefix-key`` as a header mutation.

Envoy keeps the stream open until the HTTP request ends (a streamed response's
last byte, or a client abort), so the stream's end is the request's end: that
is when its in-flight count is given back (tests/test_in_flight_lifetime.py
checks it through a real Envoy; an Envoy configured to send response headers
too is answered the same way). Asking for the response headers as well would
cost a third message a request and hold the stream no longer.

The handler reads on until Envoy ends the stream. Our bootstrap turns on Envoy's
graceful close (``envoy.reloadable_features.ext_proc_graceful_grpc_close``):
Envoy half-closes the stream, the read returns end-of-stream, the handler
returns and grpcio sends the status. Without it Envoy resets every stream, the
read in flight fails, and grpcio (1.85, grpc/grpc#43360) leaks the failed
batch's native memory: ~100 bytes a request on a busy process, and the
cancellation path costs CPU too (see docs/reliability.md).

Responses that carry no mutation are prebuilt constants: the hot path
allocates only the one body response.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from ext_proc.router import RequestRouter, RouteResult

log = logging.getLogger("prefix_router.ext_proc")

PREFIX_KEY_HEADER = "x-prefix-key"

_CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())


def _route_response(header_value: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(
                                key=PREFIX_KEY_HEADER, raw_value=header_value.encode()
                            ),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    ]
                )
            )
        )
    )


def _header(value: Any) -> str:
    raw: bytes = value.raw_value
    return raw.decode("latin-1") if raw else str(value.value)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, router: RequestRouter) -> None:
        self.router = router
        self.open_streams = 0

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        router = self.router
        tenant_header = router.table.config.tenant_header
        path = ""
        tenant = ""
        request_id = ""
        result: RouteResult | None = None
        self.open_streams += 1
        reset = True  # unless the loop below ends: a cancellation is Envoy's reset
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    for h in message.request_headers.headers.headers:
                        name = h.key
                        if name == ":path":
                            path = _header(h)
                        elif name == tenant_header:
                            tenant = _header(h)
                        elif name == "x-request-id":
                            request_id = _header(h)
                    yield _CONTINUE_REQUEST_HEADERS
                elif kind == "request_body":
                    if result is not None:  # a later chunk (streamed body): nothing to add
                        yield _CONTINUE_REQUEST_BODY
                        continue
                    body = message.request_body
                    try:
                        result = await router.route(
                            body.body,
                            path=path,
                            tenant=tenant,
                            complete=body.end_of_stream,
                            request_id=request_id,
                        )
                    except Exception as exc:  # the data path never fails a request
                        router.callbacks.on_error(exc)
                        log.exception(
                            "routing failed; request goes on unrouted",
                            extra={"request_id": request_id},
                        )
                        yield _CONTINUE_REQUEST_BODY
                        continue
                    header_value = result.decision.header_value
                    yield (
                        _route_response(header_value)
                        if header_value is not None
                        else _CONTINUE_REQUEST_BODY
                    )
                elif kind == "response_headers":
                    yield _CONTINUE_RESPONSE_HEADERS  # then read on: Envoy's close ends the loop
                elif kind == "response_body":
                    yield _CONTINUE_RESPONSE_BODY
                else:
                    log.debug("ignoring ext_proc message %s", kind)
            reset = False
        finally:
            self.open_streams -= 1
            if result is not None:
                router.finish(result)
            router.callbacks.on_stream_end(reset)
