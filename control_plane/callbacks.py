"""Hooks on xDS streams, and the registry of connected Envoys built from them.

The ADS server reports what happens through :class:`Callbacks` (every method
a no-op by default) instead of logging and counting itself.
:class:`ClientRegistry` is the callbacks the control plane installs: it
remembers, per node id, its open streams and the version each type last
ACKed or NACKed (the admin API's status) with running counts of pushes,
ACKs and NACKs per type (the control plane's metrics), and logs every NACK with Envoy's
error text, because a NACK means Envoy kept its last good config and the fleet
is not running what the admin API says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envoy.config.core.v3 import base_pb2

from control_plane.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE

log = logging.getLogger("prefix_router.control_plane.xds")

SHORT_TYPE = {CLUSTER_TYPE: "cds", ENDPOINT_TYPE: "eds"}


class Callbacks:
    """Stream hooks; override what you need."""

    def on_stream_open(self, stream_id: int, node: base_pb2.Node) -> None:
        """A stream sent its first request (the one carrying the node)."""

    def on_stream_closed(self, stream_id: int, node: base_pb2.Node | None) -> None:
        """A stream ended, normally or not."""

    def on_response(self, stream_id: int, node: base_pb2.Node, type_url: str, version: str) -> None:
        """A response with ``version`` was sent."""

    def on_ack(self, stream_id: int, node: base_pb2.Node, type_url: str, version: str) -> None:
        """Envoy applied ``version``."""

    def on_nack(
        self, stream_id: int, node: base_pb2.Node, type_url: str, version: str, error: str
    ) -> None:
        """Envoy rejected ``version`` with ``error`` and kept its previous config."""


@dataclass
class ClientStatus:
    node_id: str
    cluster: str
    streams: set[int] = field(default_factory=set)
    acked: dict[str, str] = field(default_factory=dict)
    nacked: dict[str, dict[str, Any]] = field(default_factory=dict)
    sent: dict[str, str] = field(default_factory=dict)
    last_seen: float = 0.0
    pushes: dict[str, int] = field(default_factory=dict)
    """Responses sent per type since the first stream (for metrics), like ``acks``/``nacks``."""
    acks: dict[str, int] = field(default_factory=dict)
    nacks: dict[str, int] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "cluster": self.cluster,
            "connected": bool(self.streams),
            "streams": len(self.streams),
            "sent": dict(self.sent),
            "acked": dict(self.acked),
            "nacked": dict(self.nacked),
            "last_seen": self.last_seen,
        }


FORGET_AFTER_S = 600.0
"""A client with no stream open is forgotten this long after its last one closed."""
MAX_GONE = 64
"""Clients with no stream open kept at most (the most recently seen): every Envoy pod
restart brings a new node id, and any peer of the xDS port can make up more."""


class ClientRegistry(Callbacks):
    """Connected Envoys and what each has ACKed, for status and for drain checks; clients
    gone (no stream open) are kept a while for status, within :data:`MAX_GONE` and
    :data:`FORGET_AFTER_S`."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clients: dict[str, ClientStatus] = {}
        self.clock = clock

    def _client(self, node: base_pb2.Node) -> ClientStatus:
        client = self.clients.get(node.id)
        if client is None:
            client = self.clients[node.id] = ClientStatus(node.id, node.cluster)
        client.last_seen = self.clock()
        return client

    def forget_gone(self) -> None:
        """Drop the clients gone past :data:`FORGET_AFTER_S`, beyond :data:`MAX_GONE`."""
        gone = sorted(
            (c for c in self.clients.values() if not c.streams), key=lambda c: c.last_seen
        )
        now = self.clock()
        for n, client in enumerate(gone):
            if n < len(gone) - MAX_GONE or now - client.last_seen > FORGET_AFTER_S:
                del self.clients[client.node_id]

    def on_stream_open(self, stream_id: int, node: base_pb2.Node) -> None:
        self._client(node).streams.add(stream_id)
        log.info("xDS stream %d opened by node %s", stream_id, node.id)

    def on_stream_closed(self, stream_id: int, node: base_pb2.Node | None) -> None:
        if node is not None and node.id in self.clients:
            client = self.clients[node.id]
            client.streams.discard(stream_id)
            client.last_seen = self.clock()
            log.info("xDS stream %d of node %s closed", stream_id, node.id)
        self.forget_gone()

    def on_response(self, stream_id: int, node: base_pb2.Node, type_url: str, version: str) -> None:
        client = self._client(node)
        short = SHORT_TYPE.get(type_url, type_url)
        client.sent[short] = version
        client.pushes[short] = client.pushes.get(short, 0) + 1

    def on_ack(self, stream_id: int, node: base_pb2.Node, type_url: str, version: str) -> None:
        client = self._client(node)
        short = SHORT_TYPE.get(type_url, type_url)
        client.acked[short] = version
        client.acks[short] = client.acks.get(short, 0) + 1
        client.nacked.pop(short, None)

    def on_nack(
        self, stream_id: int, node: base_pb2.Node, type_url: str, version: str, error: str
    ) -> None:
        short = SHORT_TYPE.get(type_url, type_url)
        client = self._client(node)
        client.nacked[short] = {"version": version, "error": error, "time": time.time()}
        client.nacks[short] = client.nacks.get(short, 0) + 1
        log.error(
            "node %s rejected %s version %s, keeping its last good config: %s",
            node.id,
            short,
            version,
            error,
        )

    def connected(self) -> list[ClientStatus]:
        return [c for c in self.clients.values() if c.streams]

    def to_json_list(self) -> list[dict[str, Any]]:
        self.forget_gone()
        return [c.to_json_dict() for c in sorted(self.clients.values(), key=lambda c: c.node_id)]
