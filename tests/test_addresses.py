"""Instances named by DNS: Envoy gets IP literals, the ring keeps the name."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from control_plane.cache import ALL_NODES, SnapshotCache
from control_plane.publisher import Publisher, keep_names_resolved
from control_plane.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, Snapshot, build_snapshot
from prefix_router.core.config import RouterConfig
from prefix_router.core.errors import FleetError
from prefix_router.core.fleet import (
    Fleet,
    Instance,
    canonical_address,
    check_address,
    fleet_from_file,
)
from prefix_router.envoy.addresses import is_ip_literal, names_in, publishable, resolve, resolve_now
from tests.support.wait import async_wait_until

IP = Instance("10.0.0.1", 8000)
NAMED = Instance("vllm-0.vllm.ns.svc", 8000)
GONE = Instance("vllm-9.vllm.ns.svc", 8000)
FLEET = Fleet.of([IP, NAMED, GONE], version=4)


def endpoints(snapshot: Snapshot) -> list[tuple[str, str, str | None]]:
    """(socket address, hostname, hash_key) of every published endpoint."""
    [cla_any] = snapshot.select(ENDPOINT_TYPE, frozenset())
    cla = endpoint_pb2.ClusterLoadAssignment()
    cla_any.Unpack(cla)
    out = []
    for e in cla.endpoints[0].lb_endpoints:
        meta = e.metadata.filter_metadata.get("envoy.lb")
        hash_key = meta.fields["hash_key"].string_value if meta else None
        out.append((e.endpoint.address.socket_address.address, e.endpoint.hostname, hash_key))
    return out


def ring_size(snapshot: Snapshot) -> int:
    [cluster_any] = snapshot.select(CLUSTER_TYPE, frozenset())
    cluster = cluster_pb2.Cluster()
    cluster_any.Unpack(cluster)
    return int(cluster.ring_hash_lb_config.minimum_ring_size.value)


def test_names_and_ip_literals_are_told_apart() -> None:
    assert is_ip_literal("10.0.0.1") and is_ip_literal("::1")
    assert not is_ip_literal("localhost") and not is_ip_literal("vllm-0.vllm")
    assert names_in(FLEET) == {NAMED.address, GONE.address}
    assert publishable(FLEET, {NAMED.address: "10.1.0.5"}).instances == (IP, NAMED)
    assert publishable(Fleet.of([IP]), {}) == Fleet.of([IP])


def test_a_named_instance_is_published_by_ip_and_hashed_by_its_name() -> None:
    snapshot = build_snapshot(
        FLEET, RouterConfig(), config_version=2, addresses={NAMED.address: "10.1.0.5"}
    )
    snapshot.consistent()
    # the unresolved name is left out of the endpoints and of the ring size alike
    assert endpoints(snapshot) == [
        ("10.0.0.1", IP.id, None),
        ("10.1.0.5", NAMED.id, NAMED.id),  # Envoy hashes what ext_proc's mirror hashes
    ]
    assert NAMED.ring_key == NAMED.id
    assert ring_size(snapshot) == 2 * RouterConfig().ring.entries_per_weight


def test_a_new_ip_for_the_same_name_is_a_new_snapshot_version() -> None:
    def version(ip: str) -> str:
        return build_snapshot(
            FLEET, RouterConfig(), config_version=2, addresses={NAMED.address: ip}
        ).version

    assert version("10.1.0.5") != version("10.1.0.6")
    assert version("10.1.0.5") == version("10.1.0.5")  # deterministic: replicas agree
    assert version("10.1.0.5").startswith("4.2.")
    only_ips = build_snapshot(Fleet.of([IP], version=4), RouterConfig(), config_version=2)
    assert only_ips.version == "4.2"


def test_resolving_keeps_answers_and_drops_failures() -> None:
    assert resolve_now(["localhost", "no-such-host.invalid"]) == {"localhost": "127.0.0.1"}
    answers = asyncio.run(resolve(["localhost", "no-such-host.invalid"], timeout_s=5))
    assert answers == {"localhost": "127.0.0.1"}


async def test_the_publisher_resolves_a_new_name_at_once_and_republishes() -> None:
    cache = SnapshotCache()
    publisher = Publisher(cache)
    stop = asyncio.Event()
    named = Instance("localhost", 8001)
    resolver = asyncio.create_task(keep_names_resolved(publisher, stop, interval_s=60))
    try:
        publisher.on_state(Fleet.of([IP, named], version=3), RouterConfig(), 1)
        first = cache.get_snapshot(ALL_NODES)
        assert first is not None and [e[0] for e in endpoints(first)] == ["10.0.0.1"]

        def republished() -> Any:
            published = cache.get_snapshot(ALL_NODES)
            return published if published and published.version != first.version else None

        # woken by the new name: the deadline is half the resolver's 60 s interval
        await async_wait_until(republished, 30, "the name's address is published")
        published = republished()
        assert published is not None and published.version.startswith("3.1.")
        assert endpoints(published) == [
            ("10.0.0.1", IP.id, None),
            ("127.0.0.1", named.id, named.id),
        ]
    finally:
        stop.set()
        await asyncio.wait_for(resolver, 5)


@pytest.mark.parametrize(
    "address",
    ["10.0.0.7", "fd00::7", "vllm-0.vllm.ns.svc", "vllm-0.vllm.ns.svc.", "localhost", "vllm_1"],
)
def test_an_instance_address_is_an_ip_or_a_host_name(address: str) -> None:
    check_address(address)
    assert canonical_address(address) == address


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("FD00:0::7", "fd00::7"),
        ("fd00:0000:0000:0000:0000:0000:0000:0007", "fd00::7"),
        ("::ffff:10.0.0.7", "::ffff:10.0.0.7"),  # Python and Envoy print these differently
        ("::10.0.0.7", "::10.0.0.7"),
    ],
)
def test_an_ip_is_written_as_envoy_writes_it(given: str, canonical: str) -> None:
    """Envoy hashes an IP instance's ring entries as its own canonical ``[ip]:port``:
    an address kept as typed would put ext_proc's mirror of that instance elsewhere. Where
    a fleet is written (a backend URL, a fleet file, the admin API) it is canonical."""
    assert canonical_address(given) == canonical
    assert Instance.from_url(f"http://[{given}]:8000").id == f"[{canonical}]:8000"
    assert fleet_from_file([{"address": given, "port": 8000}]).instances[0].address == canonical


def test_an_instance_read_back_from_redis_keeps_what_was_written() -> None:
    """What an older version wrote is read as it is: its id is what Redis, Envoy and the
    in-flight counts know, and a loosely typed field does not make the fleet unreadable."""
    old = {"address": "FD00:0::7", "port": 8000, "hash_key": 7, "models": "llama"}
    instance = Instance.from_json_dict(old)
    assert instance.id == "[FD00:0::7]:8000"
    assert (instance.hash_key, instance.models) == ("7", ("llama",))


@pytest.mark.parametrize(
    "address",
    ["a:b", "300.1.1.1", "1.2.3", "a" * 64, "-x", "a..b", "x y", "host/path", "a@b", "é.com"],
)
def test_anything_else_is_refused_before_it_reaches_a_url_or_a_lookup(address: str) -> None:
    with pytest.raises(FleetError, match="instance address"):
        check_address(address)


@pytest.mark.parametrize(
    ("url", "instance"),
    [
        ("http://10.0.0.7:8000", Instance("10.0.0.7", 8000)),
        ("10.0.0.7:8000:2", Instance("10.0.0.7", 8000, weight=2)),
        ("HTTP://[fd00::7]:8000/", Instance("fd00::7", 8000)),
        ("http://vllm-0:8000#llama", Instance("vllm-0", 8000, models=("llama",))),
    ],
)
def test_a_backend_url_is_an_http_instance(url: str, instance: Instance) -> None:
    assert Instance.from_url(url) == instance


@pytest.mark.parametrize(
    "url", ["https://10.0.0.7:8443", "grpc://10.0.0.7:1", "http://10.0.0.7", "http://h:8000/v1"]
)
def test_a_backend_url_envoy_would_not_reach_as_written_is_refused(url: str) -> None:
    with pytest.raises(FleetError, match="backend"):
        Instance.from_url(url)


async def test_a_name_whose_lookup_fails_keeps_its_last_address() -> None:
    """One failed lookup (a DNS hiccup, a timeout) must not take the instance off Envoy's
    ring while ext_proc's mirror keeps it: the name keeps the address it had."""
    answers = [{"vllm-1": "10.0.0.9"}, {}]
    asked = asyncio.Event()

    async def flaky(names: Any) -> dict[str, str]:
        answer = answers.pop(0) if answers else {}
        if not answers:
            asked.set()
        return answer

    cache = SnapshotCache()
    publisher = Publisher(cache)
    publisher.on_state(Fleet.of([IP, Instance("vllm-1", 8000)], version=3), RouterConfig(), 1)
    stop = asyncio.Event()
    resolver = asyncio.create_task(
        keep_names_resolved(publisher, stop, interval_s=0.05, resolver=flaky)
    )
    try:
        await asyncio.wait_for(asked.wait(), 10)
        await asyncio.sleep(0.2)  # rounds with nothing resolved
        published = cache.get_snapshot(ALL_NODES)
        assert published is not None
        assert [e[0] for e in endpoints(published)] == ["10.0.0.1", "10.0.0.9"]
    finally:
        stop.set()
        await asyncio.wait_for(resolver, 5)
