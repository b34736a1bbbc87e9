"""The model-serving cluster as Envoy sees it, built by one pure function.

The same dict feeds the static bootstrap (``prefix-router up --static``, tests)
and the control plane's CDS/EDS snapshots (parsed into protos there), so the
ring-hash sizing, health checking, outlier detection and circuit breakers are
defined once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance, InstanceState
from prefix_router.core.pools import WHOLE_FLEET_CLUSTER, layout
from prefix_router.core.ring import ring_size_for
from prefix_router.envoy.addresses import Addresses, is_ip_literal, publishable, published_address

MODEL_CLUSTER = WHOLE_FLEET_CLUSTER
PANIC_ONLY_WHEN_NONE_HEALTHY = 1.0
"""Envoy's healthy_panic_threshold, in percent: below it Envoy ignores health. Envoy
rounds it to a whole percent, so 1 is the least that works; in a fleet of under 100
instances one healthy instance is above it."""
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _duration(ms: int) -> str:
    return f"{ms / 1000:.3f}s"


_NO_ADDRESSES: Mapping[str, str] = {}


def circuit_breakers(config: RouterConfig) -> dict[str, Any]:
    """Envoy circuit-breaker thresholds from the config.

    The model cluster uses them, and so does the ext_proc cluster: every request in
    flight holds one ext_proc stream until it ends, so ext_proc must admit as many
    concurrent streams as the model cluster admits requests. Envoy's default (1,024)
    would send the 1,025th concurrent request on unrouted (``failure_mode_allow``).
    """
    cb = config.circuit_breakers
    return {
        "thresholds": [
            {
                "max_connections": cb.max_connections,
                "max_pending_requests": cb.max_pending_requests,
                "max_requests": cb.max_requests,
                "max_retries": cb.max_retries,
            }
        ]
    }


def pool_fleets(fleet: Fleet) -> dict[str, Fleet]:
    """Envoy cluster name -> the instances it holds: the whole fleet as ``models``, then a
    cluster per pool when the fleet declares models (:func:`prefix_router.core.pools.layout`,
    which ext_proc's routing table builds its pools from too)."""
    out = {MODEL_CLUSTER: fleet}
    for name, members in layout(fleet.instances).clusters().items():
        out[name] = Fleet(version=fleet.version, instances=members)
    return out


def model_clusters(
    config: RouterConfig,
    fleet: Fleet,
    *,
    eds: bool,
    lb_policy: str = "RING_HASH",
    addresses: Addresses = _NO_ADDRESSES,
) -> list[dict[str, Any]]:
    """Every model-serving cluster of the fleet (:func:`pool_fleets`), each with its own
    ring over its own instances."""
    return [
        model_cluster(config, members, eds=eds, lb_policy=lb_policy, addresses=addresses, name=name)
        for name, members in pool_fleets(fleet).items()
    ]


def load_assignments(fleet: Fleet, addresses: Addresses = _NO_ADDRESSES) -> list[dict[str, Any]]:
    """The endpoints of every cluster of :func:`model_clusters`."""
    return [
        load_assignment(members, addresses, name=name)
        for name, members in pool_fleets(fleet).items()
    ]


def model_cluster(
    config: RouterConfig,
    fleet: Fleet,
    *,
    eds: bool,
    lb_policy: str = "RING_HASH",
    addresses: Addresses = _NO_ADDRESSES,
    name: str = MODEL_CLUSTER,
) -> dict[str, Any]:
    """Envoy ``Cluster`` (JSON form) for the fleet; with ``eds`` its endpoints come from EDS.

    ``lb_policy`` other than ``RING_HASH`` (``ROUND_ROBIN``, ``LEAST_REQUEST``) is for
    benchmark baselines only: the prefix key is then ignored. ``addresses`` resolves the
    instances named by DNS (:mod:`prefix_router.envoy.addresses`); unresolved ones are left out.
    """
    fleet = publishable(fleet, addresses)
    hc = config.health_check
    od = config.outlier_detection
    cluster: dict[str, Any] = {
        "name": name,
        "connect_timeout": "1s",
        "lb_policy": lb_policy,
        **(_ring_hash_config(config, fleet) if lb_policy == "RING_HASH" else {}),
        # Close idle upstream connections before the server does (uvicorn, which vLLM
        # runs on, closes them after 5 s): a request sent on a connection the server is
        # closing would fail before reaching it and be retried on another instance,
        # where nobody counted it.
        "typed_extension_protocol_options": {
            _HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{_HTTP_OPTIONS}",
                "common_http_protocol_options": {"idle_timeout": "3s"},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "common_lb_config": {
            # While any host passes health checks, only those are used (Envoy's default
            # would, below 50% healthy, route over failing hosts too). When none passes,
            # route over all of them rather than answer every request 503: every check
            # failing at once is more likely the checker's side (a stalled Envoy host,
            # a network blip) than every instance at once.
            "healthy_panic_threshold": {"value": PANIC_ONLY_WHEN_NONE_HEALTHY},
        },
        # A host removed from EDS leaves at once, even while it still passes health checks
        # (Envoy's default keeps it, and routes to it, until a check fails).
        "ignore_health_on_host_removal": True,
        "health_checks": [
            {
                "timeout": _duration(hc.timeout_ms),
                "interval": _duration(hc.interval_ms),
                "unhealthy_threshold": hc.unhealthy_threshold,
                "healthy_threshold": hc.healthy_threshold,
                "no_traffic_interval": _duration(hc.interval_ms),
                "http_health_check": {"path": hc.path},
            }
        ],
        "outlier_detection": {
            "consecutive_5xx": od.consecutive_5xx,
            "interval": _duration(od.interval_ms),
            "base_ejection_time": _duration(od.base_ejection_time_ms),
            "max_ejection_percent": od.max_ejection_percent,
        },
        "circuit_breakers": circuit_breakers(config),
    }
    if eds:
        cluster["type"] = "EDS"
        cluster["eds_cluster_config"] = {
            "eds_config": {"ads": {}, "resource_api_version": "V3"},
            "service_name": name,
        }
    else:
        cluster["type"] = "STATIC"
        cluster["load_assignment"] = load_assignment(fleet, addresses, name=name)
    return cluster


def _ring_hash_config(config: RouterConfig, fleet: Fleet) -> dict[str, Any]:
    return {
        "ring_hash_lb_config": {
            "hash_function": "XX_HASH",
            "minimum_ring_size": str(ring_size_for(fleet.routable, config.ring.entries_per_weight)),
            "maximum_ring_size": str(8 * 1024 * 1024),
        }
    }


def load_assignment(
    fleet: Fleet, addresses: Addresses = _NO_ADDRESSES, *, name: str = MODEL_CLUSTER
) -> dict[str, Any]:
    """Envoy ``ClusterLoadAssignment`` (JSON form): every instance with an address (a
    DNS name must be in ``addresses``), draining ones marked so."""
    endpoints = []
    for instance in fleet.instances:
        address = published_address(instance, addresses)
        if address is not None:
            endpoints.append(_lb_endpoint(instance, address))
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]}


def _lb_endpoint(instance: Instance, address: str) -> dict[str, Any]:
    endpoint: dict[str, Any] = {
        "endpoint": {
            "address": {"socket_address": {"address": address, "port_value": instance.port}},
            "hostname": instance.id,
        },
        "load_balancing_weight": instance.weight,
        "health_status": _health_status(instance),
    }
    # A named instance keeps its ring position whatever IP the name resolves to: Envoy
    # hashes its id, as ext_proc's mirror does (Instance.ring_key).
    hash_key = instance.hash_key or (None if is_ip_literal(instance.address) else instance.id)
    if hash_key:
        endpoint["metadata"] = {"filter_metadata": {"envoy.lb": {"hash_key": hash_key}}}
    return endpoint


def _health_status(instance: Instance) -> str:
    if instance.state is InstanceState.DRAINING:
        return "DRAINING"
    return "HEALTHY" if instance.healthy else "UNHEALTHY"
