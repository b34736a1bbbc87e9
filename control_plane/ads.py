"""State-of-the-world Aggregated Discovery Service (ADS) over one gRPC stream per Envoy.

The server depends only on a :class:`~control_plane.cache.ConfigWatcher` and
reports through :class:`~control_plane.callbacks.Callbacks`.

Per stream and per type URL it remembers what it last sent (version, nonce,
resource names). The protocol, as Envoy speaks it:

* the first request of a type (no nonce) is answered at once with the current
  snapshot, whatever ``version_info`` Envoy holds: after a control-plane
  restart Envoy re-subscribes and gets the same state back (a resent
  identical cluster is a no-op in Envoy);
* a request whose nonce is not the last one sent for its type is stale and
  ignored;
* a request carrying the last nonce is an ACK (``error_detail`` unset) or a
  NACK (set: Envoy rejected that version and keeps its previous config). A
  NACKed version is not sent again; the next snapshot is;
* when the snapshot changes, every subscribed type whose sent version differs
  gets the new one, clusters before endpoints: endpoints follow once Envoy has
  answered (ACK or NACK) the clusters, or when it asks for endpoints while it
  processes them. A changed cluster makes Envoy warm a new one, which needs
  endpoints that arrive after it (and Envoy holds the clusters' ACK until it
  has them): endpoints sent together with the cluster went to the old cluster,
  and the new one warmed for ``initial_fetch_timeout`` (15 s) while the old one
  routed with the old ring size, where ext_proc's mirror had the new one. A
  change of requested resource names is answered even at the same version.

Each stream is one task reading requests into a queue; the handler loop takes
requests and "snapshot changed" events from that queue in order, so the
per-stream state is touched by one coroutine only. The reader stays at most
:data:`REQUESTS_AHEAD` requests ahead of the handler, and a "changed" event waits
there at most once (the handler answers with the latest snapshot anyway): a peer
that sends requests without reading the answers is held back by gRPC's flow
control instead of growing the queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from control_plane.cache import ConfigWatcher
from control_plane.callbacks import Callbacks
from control_plane.snapshot import TYPE_ORDER, Snapshot

log = logging.getLogger("prefix_router.control_plane.xds")

_CHANGED = object()
_END = object()
REQUESTS_AHEAD = 8
"""Requests a stream reads before its handler has taken them."""


@dataclass(slots=True)
class _Subscription:
    names: frozenset[str]
    sent_version: str | None = None
    sent_nonce: str | None = None
    sent_names: frozenset[str] | None = None
    sent_seq: int = 0
    """When the last response was sent, on the stream's nonce counter."""
    answered: bool = True
    """Envoy has ACKed or NACKed the last response sent (or none was sent)."""


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, watcher: ConfigWatcher, callbacks: Callbacks | None = None) -> None:
        self.watcher = watcher
        self.callbacks = callbacks or Callbacks()
        self._stream_ids = itertools.count(1)
        self._nonces = itertools.count(1)

    async def StreamAggregatedResources(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: Any
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        stream_id = next(self._stream_ids)
        events: asyncio.Queue[object] = asyncio.Queue()
        ahead = asyncio.Semaphore(REQUESTS_AHEAD)
        reader = asyncio.create_task(_read_requests(request_iterator, events, ahead))
        node: base_pb2.Node | None = None
        cancel_watch = None
        subs: dict[str, _Subscription] = {}
        change_queued = False

        def changed() -> None:
            nonlocal change_queued
            if not change_queued:
                change_queued = True
                events.put_nowait(_CHANGED)

        try:
            while True:
                event = await events.get()
                if event is _END:
                    return
                if event is _CHANGED:
                    change_queued = False
                    assert node is not None
                    response = self._next_in_order(stream_id, node, subs)
                    if response is not None:
                        yield response
                    continue
                assert isinstance(event, discovery_pb2.DiscoveryRequest)
                ahead.release()
                if node is None:
                    if not event.HasField("node") or not event.node.id:
                        log.warning("xDS stream %d: first request has no node id", stream_id)
                        return
                    node = base_pb2.Node()
                    node.CopyFrom(event.node)
                    self.callbacks.on_stream_open(stream_id, node)
                    cancel_watch = self.watcher.subscribe(node, changed)
                response = self._on_request(stream_id, node, event, subs)
                if response is not None:
                    yield response
        finally:
            reader.cancel()
            if cancel_watch is not None:
                cancel_watch()
            self.callbacks.on_stream_closed(stream_id, node)

    def _on_request(
        self,
        stream_id: int,
        node: base_pb2.Node,
        request: discovery_pb2.DiscoveryRequest,
        subs: dict[str, _Subscription],
    ) -> discovery_pb2.DiscoveryResponse | None:
        type_url = request.type_url
        if type_url not in TYPE_ORDER:
            log.warning("node %s asked for unsupported type %s", node.id, type_url)
            return None
        names = frozenset(request.resource_names)
        sub = subs.get(type_url)
        if not request.response_nonce or sub is None:
            subs[type_url] = sub = _Subscription(names=names)
            return self._respond(stream_id, node, type_url, sub, force=True)
        if request.response_nonce != sub.sent_nonce:
            return None  # stale: answers a response that a newer one superseded
        if request.HasField("error_detail"):
            self.callbacks.on_nack(
                stream_id, node, type_url, sub.sent_version or "", request.error_detail.message
            )
        else:
            self.callbacks.on_ack(stream_id, node, type_url, request.version_info)
        sub.names = names
        sub.answered = True
        pending = [subs[t] for t in _before(type_url) if t in subs and not subs[t].answered]
        if pending:
            # Envoy asks for this type while it processes an earlier one: a warming
            # cluster subscribing to its endpoints, which it needs before it ACKs. It
            # gets them again if what it has was sent before that earlier response.
            stale = sub.sent_seq < max(p.sent_seq for p in pending)
            return self._respond(stream_id, node, type_url, sub, force=stale)
        return self._next_in_order(stream_id, node, subs)

    def _next_in_order(
        self, stream_id: int, node: base_pb2.Node, subs: dict[str, _Subscription]
    ) -> discovery_pb2.DiscoveryResponse | None:
        """The next response the stream is due, in :data:`TYPE_ORDER`: nothing while a
        response of an earlier type awaits Envoy's answer, one type at a time."""
        for type_url in TYPE_ORDER:
            sub = subs.get(type_url)
            if sub is None:
                continue
            if not sub.answered:
                return None
            response = self._respond(stream_id, node, type_url, sub)
            if response is not None:
                return response
        return None

    def _respond(
        self,
        stream_id: int,
        node: base_pb2.Node,
        type_url: str,
        sub: _Subscription,
        *,
        force: bool = False,
    ) -> discovery_pb2.DiscoveryResponse | None:
        snapshot: Snapshot | None = self.watcher.fetch(node)
        if snapshot is None:
            return None
        if not force and sub.sent_version == snapshot.version and sub.sent_names == sub.names:
            return None
        seq = next(self._nonces)
        nonce = str(seq)
        response = discovery_pb2.DiscoveryResponse(
            version_info=snapshot.version,
            type_url=type_url,
            nonce=nonce,
            resources=snapshot.select(type_url, sub.names),
        )
        sub.sent_version = snapshot.version
        sub.sent_nonce = nonce
        sub.sent_names = sub.names
        sub.sent_seq = seq
        sub.answered = False
        self.callbacks.on_response(stream_id, node, type_url, snapshot.version)
        return response


def _before(type_url: str) -> tuple[str, ...]:
    return TYPE_ORDER[: TYPE_ORDER.index(type_url)]


async def _read_requests(
    requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
    events: asyncio.Queue[object],
    ahead: asyncio.Semaphore,
) -> None:
    """Queue the stream's requests, no more than ``ahead`` allows before the handler
    takes them (:data:`REQUESTS_AHEAD`)."""
    try:
        async for request in requests:
            await ahead.acquire()
            events.put_nowait(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a broken stream ends like a closed one
        log.debug("xDS stream read failed: %r", exc)
    finally:
        events.put_nowait(_END)
