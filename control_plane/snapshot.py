"""xDS snapshots: one immutable, versioned set of resources per type, built by a pure function.

A :class:`Snapshot` is what every Envoy should run: the model-serving clusters
(CDS: the whole fleet's, and one per pool when the fleet declares models) and their
endpoints (EDS) for one (fleet version, config version). It is
built once by :func:`build_snapshot` from the same JSON the static bootstrap
uses (``prefix_router.envoy.cluster``), parsed into protos and packed into
``Any`` once, so every stream sends the same bytes. The snapshot resources
never change after construction: a change is a new snapshot with a new version.

Both types carry the snapshot's version. CDS changes with membership too (the
ring's ``minimum_ring_size`` is K x the routable weight), so CDS and EDS are
always published together, in one version.

:meth:`Snapshot.consistent` checks cross-references before publishing: every
EDS cluster named by CDS has exactly one assignment, and no assignment is
orphaned (go-control-plane's ``Consistent``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.upstreams.http.v3 import (  # noqa: F401 - registers the Any type
    http_protocol_options_pb2,
)
from google.protobuf import any_pb2, json_format  # type: ignore[import-untyped]
from google.protobuf.json_format import ParseDict  # type: ignore[import-untyped]
from google.protobuf.message import Message  # type: ignore[import-untyped]

from prefix_router.core.config import RouterConfig
from prefix_router.core.errors import ConfigError, PrefixRouterError
from prefix_router.core.fleet import Fleet
from prefix_router.envoy.addresses import Addresses, names_in
from prefix_router.envoy.cluster import load_assignments, model_clusters

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
TYPE_ORDER = (CLUSTER_TYPE, ENDPOINT_TYPE)
"""Send order on a change: a cluster before its endpoints (the xDS ordering rule)."""


class InconsistentSnapshot(PrefixRouterError):
    """A snapshot whose resources do not reference each other correctly."""


def snapshot_version(
    fleet_version: int, config_version: int, addresses: Addresses = MappingProxyType({})
) -> str:
    """The xDS ``version_info``: deterministic, so every replica and restart agree. When
    instances are named by DNS, a digest of what the names resolved to is appended: a pod
    back under a new IP is a new snapshot with the same fleet version."""
    version = f"{fleet_version}.{config_version}"
    if addresses:
        text = ",".join(f"{n}={a}" for n, a in sorted(addresses.items()))
        version += "." + hashlib.sha256(text.encode()).hexdigest()[:8]
    return version


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: str
    resources: Mapping[str, Mapping[str, any_pb2.Any]]
    """type URL -> resource name -> packed resource."""

    @classmethod
    def of(cls, version: str, messages: Mapping[str, list[Message]]) -> Snapshot:
        packed: dict[str, Mapping[str, any_pb2.Any]] = {}
        for type_url, items in messages.items():
            by_name: dict[str, any_pb2.Any] = {}
            for msg in items:
                name = _resource_name(msg)
                if name in by_name:
                    raise InconsistentSnapshot(f"two {type_url} resources named {name!r}")
                any_msg = any_pb2.Any()
                any_msg.Pack(msg)
                by_name[name] = any_msg
            packed[type_url] = MappingProxyType(by_name)
        return cls(version=version, resources=MappingProxyType(packed))

    def digest(self) -> str:
        """Eight hex digits of the resources' content, the same in every replica."""
        h = hashlib.sha256()
        for type_url in sorted(self.resources):
            for name, resource in sorted(self.resources[type_url].items()):
                h.update(f"{type_url}\0{name}\0".encode())
                h.update(resource.SerializeToString(deterministic=True))
        return h.hexdigest()[:8]

    def names(self, type_url: str) -> frozenset[str]:
        return frozenset(self.resources.get(type_url, {}))

    def select(self, type_url: str, names: frozenset[str]) -> list[any_pb2.Any]:
        """Resources of ``type_url``: all of them, or only ``names`` when given."""
        by_name = self.resources.get(type_url, {})
        if not names:
            return list(by_name.values())
        return [by_name[n] for n in sorted(names) if n in by_name]

    def consistent(self) -> None:
        """Raise :class:`InconsistentSnapshot` unless EDS and CDS reference each other."""
        wanted: set[str] = set()
        for any_msg in self.resources.get(CLUSTER_TYPE, {}).values():
            cluster = cluster_pb2.Cluster()
            any_msg.Unpack(cluster)
            if cluster.type == cluster_pb2.Cluster.EDS:
                wanted.add(cluster.eds_cluster_config.service_name or cluster.name)
        have = set(self.names(ENDPOINT_TYPE))
        if missing := wanted - have:
            raise InconsistentSnapshot(f"EDS clusters without endpoints: {sorted(missing)}")
        if orphans := have - wanted:
            raise InconsistentSnapshot(f"endpoints no EDS cluster names: {sorted(orphans)}")


def _resource_name(msg: Message) -> str:
    if isinstance(msg, cluster_pb2.Cluster):
        return str(msg.name)
    if isinstance(msg, endpoint_pb2.ClusterLoadAssignment):
        return str(msg.cluster_name)
    raise InconsistentSnapshot(f"unsupported resource {msg.DESCRIPTOR.full_name}")


def build_snapshot(
    fleet: Fleet,
    config: RouterConfig,
    *,
    config_version: int,
    addresses: Addresses = MappingProxyType({}),
) -> Snapshot:
    """The snapshot every Envoy should run for this fleet and config. Pure: the instances
    named by DNS come resolved in ``addresses`` (:mod:`prefix_router.envoy.addresses`)."""
    addresses = {n: a for n, a in addresses.items() if n in names_in(fleet)}
    try:
        clusters = [
            ParseDict(c, cluster_pb2.Cluster())
            for c in model_clusters(config, fleet, eds=True, addresses=addresses)
        ]
        assignments = [
            ParseDict(a, endpoint_pb2.ClusterLoadAssignment())
            for a in load_assignments(fleet, addresses)
        ]
    except json_format.Error as exc:  # a value Envoy's types cannot hold
        raise ConfigError(f"the fleet and config make no valid Envoy resources: {exc}") from None
    return Snapshot.of(
        snapshot_version(fleet.version, config_version, addresses),
        {CLUSTER_TYPE: clusters, ENDPOINT_TYPE: assignments},
    )
