"""Envoy External Processing (ext_proc): what one stream says and what we answer.

Envoy runs the ext_proc filter with ``request_header_mode: SEND``,
``request_body_mode: BUFFERED`` and nothing else; one gRPC stream carries one
HTTP request, in two messages:

1. request headers -> remember ``:path`` and the tenant header; continue.
   (A header set here would be dropped by Envoy 1.40 in the body phase unless
   headers are SENT, which is why they are.)
2. request body (the whole body, up to the 64 MiB limit) -> route it and set
   ``x-prefix-key`` as a header mutation; in a fleet with pools by model
   (:mod:`prefix_router.core.pools`) also ``x-prefix-pool`` with the route cache cleared,
   or, for a model no instance serves, an immediate 404 (Envoy answers it, no instance
   is touched). A pooled fleet's ``GET /v1/models`` is answered immediately at step 1.

Envoy keeps the stream open until the HTTP request ends (a streamed response's
last byte, or a client abort), so the stream's end is the request's end: that
is when its in-flight count is given back (tests/test_in_flight_lifetime.py
checks it through a real Envoy; an Envoy configured to send response headers
too is answered the same way). Asking for the response headers as well would
cost a third message a request and hold the stream no longer.

Our bootstrap turns on Envoy's graceful close
(``envoy.reloadable_features.ext_proc_graceful_grpc_close``): Envoy half-closes
the stream at the request's end and we end it with status OK. Without it Envoy
resets every stream; both end the stream, a reset counted as such.

A :class:`ProcessingStream` is one stream, independent of the gRPC server
that carries it (``ext_proc.http2``, or grpcio in ``ext_proc.grpcio_server``):
it takes each message as bytes and answers bytes, at once for the headers and
with an awaitable for the body, whose routing may wait on Redis. Responses that
carry no mutation are prebuilt bytes; the hot path builds only the one body
response.
"""

from __future__ import annotations

import logging

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from ext_proc.http2.grpc_server import Answer, GrpcError, StatusCode
from ext_proc.router import PendingRoute, RequestRouter, RouteResult
from prefix_router.core.pools import POOL_HEADER

log = logging.getLogger("prefix_router.ext_proc")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH = f"/{SERVICE_NAME}/Process"
PREFIX_KEY_HEADER = "x-prefix-key"
MODELS_PATH = "/v1/models"


def _serialized(response: pb.ProcessingResponse) -> bytes:
    return response.SerializeToString()  # type: ignore[no-any-return]


CONTINUE = {
    "request_headers": _serialized(pb.ProcessingResponse(request_headers=pb.HeadersResponse())),
    "request_body": _serialized(pb.ProcessingResponse(request_body=pb.BodyResponse())),
    "response_headers": _serialized(pb.ProcessingResponse(response_headers=pb.HeadersResponse())),
    "response_body": _serialized(pb.ProcessingResponse(response_body=pb.BodyResponse())),
    "request_trailers": _serialized(pb.ProcessingResponse(request_trailers=pb.TrailersResponse())),
    "response_trailers": _serialized(
        pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    ),
}
"""Answers that change nothing, by the message they answer."""
_CONTINUE_BODY = CONTINUE["request_body"]


def route_response_message(
    header_value: str | None, pool_header: str | None = None
) -> pb.ProcessingResponse:
    """The body answer that sets ``x-prefix-key`` (what Envoy's ring hash reads) and, for a
    request of a pool, ``x-prefix-pool`` (the pool's cluster) with the route cache cleared,
    so Envoy picks the pool's route after this answer."""
    headers = [(PREFIX_KEY_HEADER, header_value)] if header_value is not None else []
    if pool_header is not None:
        headers.append((POOL_HEADER, pool_header))
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                        for name, value in headers
                    ]
                ),
                clear_route_cache=pool_header is not None,
            )
        )
    )


def immediate_response(status: int, body: bytes) -> bytes:
    """An answer Envoy sends the client itself, the request going to no instance: JSON,
    as vLLM's OpenAI server answers."""
    return _serialized(
        pb.ProcessingResponse(
            immediate_response=pb.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=status),
                headers=pb.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(
                                key="content-type", raw_value=b"application/json"
                            ),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    ]
                ),
                body=body,
            )
        )
    )


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field: tag byte, varint length, payload."""
    size = len(payload)
    length = bytearray()
    while size >= 0x80:
        length.append((size & 0x7F) | 0x80)
        size >>= 7
    length.append(size)
    return bytes((tag,)) + length + payload


_KEY_FIELD = _field(0x0A, PREFIX_KEY_HEADER.encode())  # HeaderValue.key (1)
_POOL_FIELD = _field(0x0A, POOL_HEADER.encode())
_OVERWRITE = b"\x18" + bytes((base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,))
_CLEAR_ROUTE_CACHE = b"\x28\x01"  # CommonResponse.clear_route_cache (5) = true


def _set_header(name_field: bytes, value: str) -> bytes:
    """One ``HeaderMutation.set_headers`` entry (field 1)."""
    raw = value.encode()
    header = name_field + (_field(0x1A, raw) if raw else b"")  # HeaderValue.raw_value (3)
    return _field(0x0A, _field(0x0A, header) + _OVERWRITE)  # .header (1), .append_action


def route_response(header_value: str | None, pool_header: str | None = None) -> bytes:
    """:func:`route_response_message` serialized, written directly: the protobuf builder
    cost ~26 us of ~250 a request. (tests/test_ext_proc_servicer.py holds the bytes equal.)"""
    mutation = b"" if header_value is None else _set_header(_KEY_FIELD, header_value)
    tail = b""
    if pool_header is not None:
        mutation += _set_header(_POOL_FIELD, pool_header)
        tail = _CLEAR_ROUTE_CACHE
    common = _field(0x12, mutation) + tail  # CommonResponse.header_mutation (2)
    return _field(0x1A, _field(0x0A, common))  # ProcessingResponse.request_body (3).response (1)


def _header(value: base_pb2.HeaderValue) -> str:
    raw: bytes = value.raw_value
    return raw.decode("latin-1") if raw else str(value.value)


class ExternalProcessor:
    """ext_proc's method: a :class:`ProcessingStream` per stream, over one router."""

    def __init__(self, router: RequestRouter) -> None:
        self.router = router
        self.open_streams = 0

    def open(self) -> ProcessingStream:
        self.open_streams += 1
        return ProcessingStream(self)


class ProcessingStream:
    """One ext_proc stream, that is one HTTP request through Envoy."""

    __slots__ = (
        "_processor",
        "_path",
        "_method",
        "_tenant",
        "_request_id",
        "_routing",
        "_result",
        "_ended",
    )

    def __init__(self, processor: ExternalProcessor) -> None:
        self._processor = processor
        self._path = ""
        self._method = ""
        self._tenant = ""
        self._request_id = ""
        self._routing = False
        self._result: RouteResult | None = None
        self._ended = False

    def on_message(self, message: bytes) -> Answer:
        try:
            request = pb.ProcessingRequest.FromString(message)
        except DecodeError as exc:
            raise GrpcError(StatusCode.INVALID_ARGUMENT, f"not a ProcessingRequest: {exc}") from exc
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            tenant_header = self._processor.router.table.config.tenant_header
            for h in request.request_headers.headers.headers:
                name = h.key
                if name == ":path":
                    self._path = _header(h)
                elif name == ":method":
                    self._method = _header(h)
                elif name == tenant_header:
                    self._tenant = _header(h)
                elif name == "x-request-id":
                    self._request_id = _header(h)
            if self._method == "GET" and self._path.split("?", 1)[0] == MODELS_PATH:
                table = self._processor.router.table
                if table.pooled:  # the fleet's models; unpooled, an instance answers
                    return immediate_response(200, table.models_body)
        elif kind == "request_body" and not self._routing:
            self._routing = True  # later chunks of a streamed body: nothing to add
            return self._route_body(request.request_body)
        return CONTINUE.get(kind or "")

    def _route_body(self, body: pb.HttpBody) -> Answer:
        """The body's answer: at once when the router decides without waiting (no task,
        no loop turn), else a coroutine that waits for its decision."""
        try:
            result = self._processor.router.route_at_once(
                body.body,
                path=self._path,
                tenant=self._tenant,
                complete=body.end_of_stream,
                request_id=self._request_id,
            )
        except Exception as exc:  # the data path never fails a request
            return self._failed(exc)
        if isinstance(result, RouteResult):
            return self._answer(result)
        return self._route(result)

    async def _route(self, pending: PendingRoute) -> bytes:
        try:
            result = await self._processor.router.finish_route(pending)
        except Exception as exc:  # the data path never fails a request
            return self._failed(exc)
        return self._answer(result)

    def _failed(self, exc: Exception) -> bytes:
        self._processor.router.callbacks.on_error(exc)
        log.exception(
            "routing failed; request goes on unrouted",
            extra={"request_id": self._request_id},
        )
        return _CONTINUE_BODY

    def _answer(self, result: RouteResult) -> bytes:
        router = self._processor.router
        if self._ended:  # Envoy ended the stream while we routed: nothing holds the count
            router.finish(result)
            return _CONTINUE_BODY
        if result.answer is not None:
            return immediate_response(404, result.answer)
        self._result = result
        decision = result.decision
        if decision.header_value is None and decision.pool_header is None:
            return _CONTINUE_BODY
        return route_response(decision.header_value, decision.pool_header)

    def on_end(self, cancelled: bool) -> None:
        """The stream is over: give back the request's in-flight count."""
        if self._ended:
            return
        self._ended = True
        processor = self._processor
        processor.open_streams -= 1
        if self._result is not None:
            processor.router.finish(self._result)
        processor.router.callbacks.on_stream_end(cancelled)
