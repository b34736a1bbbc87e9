"""The standard gRPC health service (``grpc.health.v1.Health/Check``) on our gRPC server.

Kubernetes' gRPC probes, ``grpc_health_probe`` and the compose health check ask
``Check``; ``Watch`` (a stream of changes) is not served and answers UNIMPLEMENTED,
which such clients read as "ask Check instead".
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from ext_proc.http2.grpc_server import Answer, GrpcError, Method, StatusCode

CHECK_PATH = "/grpc.health.v1.Health/Check"


class HealthStatus:
    """Whether each service name is serving; ``""`` is the server as a whole."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self._serving = dict.fromkeys(("", *services), False)

    def set_serving(self, serving: bool) -> None:
        for name in self._serving:
            self._serving[name] = serving

    def answer(self, service: str) -> bytes:
        if service not in self._serving:
            raise GrpcError(StatusCode.NOT_FOUND, f"unknown service {service!r}")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._serving[service]
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status).SerializeToString()  # type: ignore[no-any-return]

    def check_method(self) -> Method:
        return lambda: _Check(self)


class _Check:
    def __init__(self, status: HealthStatus) -> None:
        self._status = status

    def on_message(self, message: bytes) -> Answer:
        try:
            request = health_pb2.HealthCheckRequest.FromString(message)
        except Exception as exc:  # protobuf's DecodeError
            raise GrpcError(StatusCode.INVALID_ARGUMENT, f"bad HealthCheckRequest: {exc}") from exc
        return self._status.answer(request.service)

    def on_end(self, cancelled: bool) -> None:
        pass
