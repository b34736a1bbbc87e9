"""Limits on every peer of the xDS port, enforced by gRPC itself.

The xDS server is grpcio's (``grpc.aio``), whose core implements each limit below; this
module only names them, gives each a safe default and builds the server with them. Each
Envoy holds one connection with one ADS stream (and a Kubernetes gRPC probe opens one of
its own for a moment), so the defaults leave a fleet of hundreds of Envoys far inside them
while a peer that opens connections and says nothing, or opens streams without end, is
held to a bound:

* a connection that has not finished HTTP/2's handshake (the preface and SETTINGS) in
  ``handshake_timeout_s`` is closed (gRPC's default waits 120 s);
* at most ``max_connections`` connections at once: one more is closed as it is accepted,
  so the process's file descriptors cannot run out;
* a connection with no call open for ``idle_timeout_s`` is closed (an ADS stream keeps an
  Envoy's open for good; Envoy reconnects on its own anyway);
* at most ``max_streams_per_connection`` streams at once on a connection (advertised in
  SETTINGS_MAX_CONCURRENT_STREAMS: a client waits for a stream to end before it opens
  another);
* at most ``max_calls`` calls at once in the process: one more is refused with
  RESOURCE_EXHAUSTED.

gRPC core keeps no count of these that Python can read, so they are not exported as
metrics; the limits are in ``prefix-router control-plane --help`` and docs/control-plane.md.
``tests/test_control_plane_xds_limits.py`` checks each over real sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class XdsLimits:
    max_connections: int = 512
    max_streams_per_connection: int = 16
    max_calls: int = 1024
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_streams_per_connection", "max_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("handshake_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")

    def server_options(self) -> list[tuple[str, int]]:
        """grpcio's channel arguments for these limits (``max_calls`` is a constructor
        argument of its own: :func:`xds_grpc_server`)."""
        return [
            ("grpc.so_reuseport", 0),  # a second control plane on the port must fail to bind
            ("grpc.server_handshake_timeout_ms", _ms(self.handshake_timeout_s)),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", _ms(self.idle_timeout_s)),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            # Envoy PINGs its ADS connection (the bootstrap's connection_keepalive): allow it
            # outright; gRPC's default policy allows one PING a 5 minutes without data and
            # answers more with GOAWAY (a 55 s idle run saw none, but it is not ours to lean on)
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ]


MIN_PING_INTERVAL_MS = 10_000
"""Shortest gap between two PINGs a peer may send (Envoy's: 15 s)."""


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def xds_grpc_server(limits: XdsLimits) -> grpc.aio.Server:
    """The control plane's gRPC server (ADS and health), held to ``limits``."""
    return grpc.aio.server(
        options=limits.server_options(), maximum_concurrent_rpcs=limits.max_calls
    )
