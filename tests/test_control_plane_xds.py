"""Snapshots (pure) and the ADS protocol over a real in-process gRPC stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from control_plane.ads import REQUESTS_AHEAD, AdsServer
from control_plane.cache import ALL_NODES, SnapshotCache
from control_plane.callbacks import FORGET_AFTER_S, MAX_GONE, ClientRegistry
from control_plane.publisher import Publisher
from control_plane.snapshot import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    InconsistentSnapshot,
    Snapshot,
    build_snapshot,
)
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance, InstanceState
from prefix_router.ops.procs import free_port
from tests.support.wait import async_wait_until

A = Instance("10.0.0.1", 8000)
B = Instance("10.0.0.2", 8000, weight=3, hash_key="b")
C = Instance("10.0.0.3", 8000, state=InstanceState.DRAINING, draining_since=1.0)


def snap(fleet_version: int = 1, *instances: Instance) -> Snapshot:
    fleet = Fleet.of(list(instances or (A, B)), version=fleet_version)
    return build_snapshot(fleet, RouterConfig(), config_version=1)


def unpack(any_msg: Any, message: Any) -> Any:
    any_msg.Unpack(message)
    return message


# -- snapshots (pure) ---------------------------------------------------------


def test_snapshot_carries_the_versioned_eds_cluster_and_its_endpoints() -> None:
    s = build_snapshot(Fleet.of([A, B, C], version=7), RouterConfig(), config_version=3)
    s.consistent()
    assert s.version == "7.3"
    [cluster_any] = s.select(CLUSTER_TYPE, frozenset())
    cluster = unpack(cluster_any, cluster_pb2.Cluster())
    assert cluster.type == cluster_pb2.Cluster.EDS
    assert cluster.lb_policy == cluster_pb2.Cluster.RING_HASH
    # K x routable weight: A (1) + B (3); draining C is out of the ring.
    assert cluster.ring_hash_lb_config.minimum_ring_size.value == 256 * 4
    assert cluster.health_checks[0].http_health_check.path == "/health"
    assert cluster.outlier_detection.consecutive_5xx.value == 5
    assert cluster.circuit_breakers.thresholds[0].max_requests.value == 100_000
    [cla_any] = s.select(ENDPOINT_TYPE, frozenset({"models"}))
    cla = unpack(cla_any, endpoint_pb2.ClusterLoadAssignment())
    hosts = [
        (e.endpoint.hostname, health_check_pb2.HealthStatus.Name(e.health_status))
        for e in cla.endpoints[0].lb_endpoints
    ]
    assert hosts == [(A.id, "HEALTHY"), (B.id, "HEALTHY"), (C.id, "DRAINING")]


def test_config_values_reach_the_cluster() -> None:
    config = RouterConfig().patched(
        {"health_check": {"path": "/ready"}, "circuit_breakers": {"max_requests": 7}}
    )
    s = build_snapshot(Fleet.of([A]), config, config_version=2)
    cluster = unpack(s.select(CLUSTER_TYPE, frozenset())[0], cluster_pb2.Cluster())
    assert cluster.health_checks[0].http_health_check.path == "/ready"
    assert cluster.circuit_breakers.thresholds[0].max_requests.value == 7


def test_cluster_with_missing_endpoints_is_inconsistent() -> None:
    cluster = unpack(snap().select(CLUSTER_TYPE, frozenset())[0], cluster_pb2.Cluster())
    with pytest.raises(InconsistentSnapshot, match="without endpoints"):
        Snapshot.of("1", {CLUSTER_TYPE: [cluster]}).consistent()


def test_endpoints_without_a_cluster_are_inconsistent() -> None:
    cla = unpack(snap().select(ENDPOINT_TYPE, frozenset())[0], endpoint_pb2.ClusterLoadAssignment())
    with pytest.raises(InconsistentSnapshot, match="no EDS cluster"):
        Snapshot.of("1", {ENDPOINT_TYPE: [cla]}).consistent()


def test_duplicate_resource_names_are_refused() -> None:
    cla = unpack(snap().select(ENDPOINT_TYPE, frozenset())[0], endpoint_pb2.ClusterLoadAssignment())
    with pytest.raises(InconsistentSnapshot, match="two"):
        Snapshot.of("1", {ENDPOINT_TYPE: [cla, cla]})


def test_a_published_snapshot_cannot_be_changed() -> None:
    s = snap()
    with pytest.raises(TypeError):
        s.resources[CLUSTER_TYPE]["other"] = s.resources[CLUSTER_TYPE]["models"]  # type: ignore[index]


def test_the_publisher_never_goes_back_to_an_older_state() -> None:
    cache = SnapshotCache()
    publisher = Publisher(cache)
    publisher.on_state(Fleet.of([A, B], version=5), RouterConfig(), 2)
    publisher.on_state(Fleet.of([], version=0), RouterConfig(), 0)  # Redis was flushed
    published = cache.get_snapshot(ALL_NODES)
    assert published is not None and published.version == "5.2"
    publisher.on_state(Fleet.of([A], version=6), RouterConfig(), 2)
    published = cache.get_snapshot(ALL_NODES)
    assert published is not None and published.version == "6.2"


def test_a_version_published_again_with_other_content_is_told_apart() -> None:
    """Redis went back (another replica restored an older fleet), and the next change
    brought the fleet's version back to the one published: Envoy skips a version it has,
    so the new content gets a version of its own, the same in every replica."""
    cache = SnapshotCache()
    publisher = Publisher(cache)
    publisher.on_state(Fleet.of([A, B], version=2), RouterConfig(), 1)
    first = cache.get_snapshot(ALL_NODES)
    publisher.on_state(Fleet.of([A], version=1), RouterConfig(), 1)  # refused: older
    publisher.on_state(Fleet.of([A.with_changes(weight=5)], version=2), RouterConfig(), 1)
    second = cache.get_snapshot(ALL_NODES)
    assert first is not None and second is not None
    assert first.version == "2.1" and second.version == f"2.1.{second.digest()}"
    assert second.resources != first.resources
    again = Publisher(SnapshotCache())  # another replica, the same states
    again.on_state(Fleet.of([A, B], version=2), RouterConfig(), 1)
    again.on_state(Fleet.of([A.with_changes(weight=5)], version=2), RouterConfig(), 1)
    assert again.published is not None and again.published.version == second.version
    # the same state read again: the same snapshot, nothing new to send
    publisher.on_state(Fleet.of([A.with_changes(weight=5)], version=2), RouterConfig(), 1)
    assert cache.get_snapshot(ALL_NODES) is second
    publisher.on_state(Fleet.of([A], version=3), RouterConfig(), 1)  # and on, as before
    assert publisher.published is not None and publisher.published.version == "3.1"


# -- ADS over gRPC -------------------------------------------------------------


class Envoyish:
    """One ADS stream driven like Envoy drives it."""

    def __init__(self, channel: grpc.aio.Channel, node_id: str) -> None:
        self.node = base_pb2.Node(id=node_id, cluster="test")
        self.requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
            self._iter()
        )
        self.first = True
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        # A timed-out read() would cancel the whole call, so one task reads them all.
        try:
            async for response in self.call:
                self.responses.put_nowait(response)
        except grpc.aio.AioRpcError:
            pass
        self.responses.put_nowait(grpc.aio.EOF)

    async def _iter(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (req := await self.requests.get()) is not None:
            yield req

    def send(
        self,
        type_url: str,
        *,
        version: str = "",
        nonce: str = "",
        error: str = "",
        names: tuple[str, ...] = (),
    ) -> None:
        req = discovery_pb2.DiscoveryRequest(
            type_url=type_url,
            version_info=version,
            response_nonce=nonce,
            resource_names=list(names),
        )
        if self.first:
            req.node.CopyFrom(self.node)
            self.first = False
        if error:
            req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        self.requests.put_nowait(req)

    async def recv(self, timeout: float = 2.0) -> Any:
        return await asyncio.wait_for(self.responses.get(), timeout)

    async def silent(self, timeout: float = 0.3) -> bool:
        try:
            await asyncio.wait_for(self.responses.get(), timeout)
        except TimeoutError:
            return True
        return False

    def ack(self, response: discovery_pb2.DiscoveryResponse, **kw: Any) -> None:
        self.send(response.type_url, version=response.version_info, nonce=response.nonce, **kw)

    async def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


@pytest.fixture
async def xds() -> AsyncIterator[tuple[SnapshotCache, ClientRegistry, grpc.aio.Channel]]:
    cache, clients = SnapshotCache(), ClientRegistry()
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(AdsServer(cache, clients), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield cache, clients, channel
    finally:
        await channel.close()
        await server.stop(grace=None)


XdsFixture = tuple[SnapshotCache, ClientRegistry, grpc.aio.Channel]


async def expect(envoy: Envoyish, type_url: str, version: str) -> Any:
    """The next response, which must be of ``type_url`` at ``version``."""
    response = await envoy.recv()
    assert (response.type_url, response.version_info) == (type_url, version)
    return response


async def subscribe(envoy: Envoyish) -> tuple[Any, Any]:
    envoy.send(CLUSTER_TYPE)
    cds = await envoy.recv()
    envoy.ack(cds)
    envoy.send(ENDPOINT_TYPE, names=("models",))
    eds = await envoy.recv()
    envoy.ack(eds, names=("models",))
    return cds, eds


async def test_subscribe_ack_and_push_clusters_then_endpoints_once_envoy_has_the_cluster(
    xds: XdsFixture,
) -> None:
    cache, clients, channel = xds
    cache.set_snapshot(ALL_NODES, snap(1))
    envoy = Envoyish(channel, "e1")
    cds, eds = await subscribe(envoy)
    assert (cds.type_url, cds.version_info) == (CLUSTER_TYPE, "1.1")
    assert (eds.type_url, eds.version_info) == (ENDPOINT_TYPE, "1.1")
    assert await envoy.silent()  # ACKs are not answered
    assert clients.clients["e1"].acked == {"cds": "1.1", "eds": "1.1"}

    cache.set_snapshot(ALL_NODES, snap(2, A))
    first = await expect(envoy, CLUSTER_TYPE, "2.1")
    # Endpoints wait for the cluster's ACK: Envoy's warming cluster must be there to take them.
    assert await envoy.silent()
    envoy.ack(first)
    second = await expect(envoy, ENDPOINT_TYPE, "2.1")
    cla = unpack(second.resources[0], endpoint_pb2.ClusterLoadAssignment())
    assert [e.endpoint.hostname for e in cla.endpoints[0].lb_endpoints] == [A.id]
    await envoy.close()


async def test_a_warming_cluster_asking_for_endpoints_gets_them_before_it_acks(
    xds: XdsFixture,
) -> None:
    """Envoy holds the ACK of a changed cluster until the cluster has warmed, which
    takes endpoints: its request for them (at the last nonce) is answered at once."""
    cache, _, channel = xds
    cache.set_snapshot(ALL_NODES, snap(1))
    envoy = Envoyish(channel, "e1")
    _, eds = await subscribe(envoy)
    assert await envoy.silent()
    cache.set_snapshot(ALL_NODES, snap(2, A))
    cds = await expect(envoy, CLUSTER_TYPE, "2.1")
    envoy.ack(eds, names=("models",))  # the warming cluster subscribes, CDS not yet ACKed
    endpoints = await expect(envoy, ENDPOINT_TYPE, "2.1")
    envoy.ack(cds)
    envoy.ack(endpoints, names=("models",))
    assert await envoy.silent()
    await envoy.close()


async def test_a_cluster_sent_after_its_endpoints_gets_them_again_when_it_asks(
    xds: XdsFixture,
) -> None:
    """Two changes in a row: the endpoints of the second went out (to the warming first
    cluster) before the second cluster did. When the second asks, it gets them again,
    though Envoy already holds that version; otherwise it warms for 15 s."""
    cache, _, channel = xds
    cache.set_snapshot(ALL_NODES, snap(1))
    envoy = Envoyish(channel, "e1")
    _, eds1 = await subscribe(envoy)
    assert await envoy.silent()
    cache.set_snapshot(ALL_NODES, snap(2, A))
    cds2 = await envoy.recv()
    envoy.ack(eds1, names=("models",))
    eds2 = await envoy.recv()
    cache.set_snapshot(ALL_NODES, snap(3, B))
    assert await envoy.silent()  # the clusters of 3 wait for the ACK of 2
    envoy.ack(eds2, names=("models",))
    eds3 = await expect(envoy, ENDPOINT_TYPE, "3.1")
    envoy.ack(cds2)
    cds3 = await expect(envoy, CLUSTER_TYPE, "3.1")
    envoy.ack(eds3, names=("models",))  # the warming cluster of 3 subscribes
    again = await expect(envoy, ENDPOINT_TYPE, "3.1")
    envoy.ack(cds3)
    envoy.ack(again, names=("models",))
    assert await envoy.silent()
    await envoy.close()


async def test_a_nack_is_recorded_with_envoys_error_and_the_version_not_resent(
    xds: XdsFixture,
) -> None:
    cache, clients, channel = xds
    cache.set_snapshot(ALL_NODES, snap(1))
    envoy = Envoyish(channel, "e1")
    await subscribe(envoy)
    cache.set_snapshot(ALL_NODES, snap(2, A))
    bad_cds = await envoy.recv()
    # Envoy rejects the cluster: it answers with its last good version and the error.
    envoy.send(CLUSTER_TYPE, version="1.1", nonce=bad_cds.nonce, error="bad cluster: boom")
    bad_eds = await envoy.recv()  # a NACK answers too: the old cluster takes the endpoints
    assert bad_eds.type_url == ENDPOINT_TYPE
    envoy.ack(bad_eds, names=("models",))
    assert await envoy.silent()
    status = clients.clients["e1"]
    assert status.acked["cds"] == "1.1"
    assert status.nacked["cds"]["version"] == "2.1"
    assert status.nacked["cds"]["error"] == "bad cluster: boom"
    cache.set_snapshot(ALL_NODES, snap(3, A))
    fixed = await expect(envoy, CLUSTER_TYPE, "3.1")
    envoy.ack(fixed)
    await envoy.recv()
    await async_wait_until(lambda: "cds" not in clients.clients["e1"].nacked, 30, "NACK cleared")
    await envoy.close()


async def test_a_stale_nonce_is_ignored(xds: XdsFixture) -> None:
    cache, _, channel = xds
    cache.set_snapshot(ALL_NODES, snap(1))
    envoy = Envoyish(channel, "e1")
    cds, _ = await subscribe(envoy)
    assert await envoy.silent()  # the ACKs are in before the change
    cache.set_snapshot(ALL_NODES, snap(2))
    newer = await envoy.recv()
    envoy.send(CLUSTER_TYPE, version="0", nonce=cds.nonce, error="old news")
    assert await envoy.silent()  # neither answered nor taken as the ACK endpoints wait for
    envoy.ack(newer)
    assert (await envoy.recv()).type_url == ENDPOINT_TYPE
    await envoy.close()


async def test_several_nodes_and_a_reconnect_get_the_same_state(xds: XdsFixture) -> None:
    cache, clients, channel = xds
    envoys = [Envoyish(channel, f"e{i}") for i in range(3)]
    for e in envoys:
        e.send(CLUSTER_TYPE)
    assert all([await e.silent(0.1) for e in envoys])  # nothing to send before a snapshot
    cache.set_snapshot(ALL_NODES, snap(4))
    versions = [(await e.recv()).version_info for e in envoys]
    assert versions == ["4.1"] * 3
    for e in envoys:
        await e.close()
    # A new stream (Envoy reconnecting) that already holds 4.1 is answered anyway.
    again = Envoyish(channel, "e0")
    again.send(CLUSTER_TYPE, version="4.1")
    assert (await again.recv()).version_info == "4.1"
    await async_wait_until(
        lambda: clients.clients["e0"].streams and not clients.clients["e1"].streams,
        30,
        "e0 reconnected and the closed streams are gone",
    )
    await again.close()


async def test_a_stream_without_a_node_id_is_closed(xds: XdsFixture) -> None:
    cache, _, channel = xds
    cache.set_snapshot(ALL_NODES, snap(1))
    envoy = Envoyish(channel, "")
    envoy.send(CLUSTER_TYPE)
    assert await envoy.recv() is grpc.aio.EOF
    await envoy.close()


class _CountingAds(AdsServer):  # type: ignore[misc]
    """The ADS server, counting the requests it reads from its peers."""

    read = 0
    answered = 0

    async def StreamAggregatedResources(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: Any
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async def counted() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            async for request in request_iterator:
                _CountingAds.read += 1
                yield request

        async for response in super().StreamAggregatedResources(counted(), context):
            _CountingAds.answered += 1
            yield response


async def test_a_peer_that_reads_no_answers_is_held_back_not_buffered() -> None:
    """A peer that keeps asking for endpoints (~80 KB an answer) and reads none of the
    answers: once they fill its window the stream's handler waits, and the server reads
    at most REQUESTS_AHEAD (+1) requests more; gRPC's flow control holds the peer back.
    Without that bound the server read every request into memory."""
    cache = SnapshotCache()
    fleet = [Instance(f"10.1.{i // 250}.{i % 250}", 8000) for i in range(2000)]
    cache.set_snapshot(ALL_NODES, snap(1, *fleet))
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_CountingAds(cache), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    _CountingAds.read = _CountingAds.answered = 0
    requests: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()
    for i in range(2000):
        request = discovery_pb2.DiscoveryRequest(
            type_url=ENDPOINT_TYPE, resource_names=["models"] + [f"pad-{i}-{j}" for j in range(400)]
        )
        if i == 0:
            request.node.CopyFrom(base_pb2.Node(id="greedy", cluster="test"))
        requests.put_nowait(request)

    async def send() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while not requests.empty():
            yield requests.get_nowait()

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(send())
    try:
        first = await asyncio.wait_for(call.read(), 5)  # one answer read, then no more
        assert len(first.SerializeToString()) > 50_000
        # the peer keeps sending until the server stops reading: wait until it has
        deadline, seen = time.monotonic() + 30, -1
        while _CountingAds.read != seen:
            assert time.monotonic() < deadline, "the server never stopped reading"
            seen = _CountingAds.read
            await asyncio.sleep(0.5)
        assert requests.qsize() > 0  # flow control held the peer back before it sent them all
        # answers fill the peer's window (as many as its window holds); past them the
        # server reads at most REQUESTS_AHEAD requests more (+1 in the handler's hands)
        assert _CountingAds.read - _CountingAds.answered <= REQUESTS_AHEAD + 2, (
            _CountingAds.read,
            _CountingAds.answered,
        )
    finally:
        call.cancel()
        await channel.close()
        await server.stop(grace=None)


def test_clients_gone_are_forgotten_within_a_bound() -> None:
    """Every Envoy pod restart is a new node id, and any peer of the xDS port can make up
    more: clients with no stream open are kept for status, the most recent MAX_GONE, for
    FORGET_AFTER_S at most; connected ones always."""
    now = [1000.0]
    registry = ClientRegistry(clock=lambda: now[0])
    staying = base_pb2.Node(id="envoy-staying")
    registry.on_stream_open(0, staying)
    for n in range(1, MAX_GONE + 50):
        node = base_pb2.Node(id=f"envoy-{n}")
        registry.on_stream_open(n, node)
        now[0] += 1
        registry.on_stream_closed(n, node)
    gone = [c for c in registry.clients.values() if not c.streams]
    assert len(gone) == MAX_GONE and "envoy-1" not in registry.clients
    assert f"envoy-{MAX_GONE + 49}" in registry.clients
    now[0] += FORGET_AFTER_S + 1
    assert [c["node_id"] for c in registry.to_json_list()] == ["envoy-staying"]
