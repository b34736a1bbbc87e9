"""Render ``envoy/bootstrap.yaml`` for one Envoy.

Two fleet sources:

* ``static``: the model cluster and its endpoints are written into the
  bootstrap (a fixed fleet; the walking skeleton and single-file setups);
* ``xds``: Envoy learns the cluster and endpoints from the control plane over
  ADS (CDS + EDS), and follows every change made through the admin API.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from prefix_router.core.config import RouterConfig
from prefix_router.core.errors import ConfigError
from prefix_router.core.fleet import Fleet
from prefix_router.core.pools import POOL_CLUSTER_PREFIX, POOL_HEADER
from prefix_router.envoy.addresses import is_ip_literal, names_in, resolve_now
from prefix_router.envoy.cluster import MODEL_CLUSTER, circuit_breakers, model_clusters

XDS_CLUSTER = "xds"
MIN_GRPC_CLIENT_IDLE_S = 5
EXT_PROC_CLUSTER = "ext_proc"
ADMIN_CLUSTER = "envoy_admin"
PROBE_LISTENER = "probes"
PROBE_PATHS = ("/ready", "/stats/prometheus")
"""What the probe listener passes on to Envoy's admin interface; every other path gets 404."""
PROBE_MAX_CONNECTIONS = 64
"""Open connections the probe listener keeps (kubelet and Prometheus need a few)."""
EXT_PROC_MAX_CONCURRENT_STREAMS = 1_000
"""ext_proc's default ``--h2-max-concurrent-streams`` (tests hold the two equal)."""


DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""Larger request bodies get 413 from Envoy."""
BODY_BUFFER_SLACK = 64 * 1024
"""Envoy buffers this much more than the largest body it routes."""
DEFAULT_EXT_PROC_TIMEOUT_MS = 500
XDS_KEEPALIVE_INTERVAL = "15s"
XDS_KEEPALIVE_TIMEOUT = "5s"
"""Envoy PINGs the control plane this often and reconnects if no answer comes this soon."""


def template_path() -> Path:
    """The bootstrap template: ``envoy/bootstrap.yaml``, linked beside this module in a
    checkout and copied there in a wheel."""
    return Path(str(resources.files("prefix_router.envoy") / "bootstrap.yaml"))


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapParams:
    listen_address: str = "127.0.0.1"
    listen_port: int
    admin_address: str = "127.0.0.1"
    """Envoy's admin interface: unauthenticated and able to stop Envoy, so loopback by
    default; containers expose :attr:`probe_port` instead."""
    admin_port: int
    probe_address: str = "127.0.0.1"
    probe_port: int | None = None
    """A listener serving only ``GET /ready`` and ``GET /stats/prometheus`` (proxied to the
    admin interface) for the kubelet's probes and Prometheus; None: no such listener."""
    ext_proc: tuple[tuple[str, int], ...]
    """``(host, port)`` of every ext_proc process; Envoy balances streams over them."""
    node_id: str = "prefix-router-envoy"
    xds: tuple[str, int] | None = None
    """Control plane ``(host, port)``; None for a static fleet."""
    body_buffer_bytes: int = DEFAULT_MAX_BODY_BYTES + BODY_BUFFER_SLACK
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    ext_proc_timeout_ms: int = DEFAULT_EXT_PROC_TIMEOUT_MS
    """Envoy waits this long for each ext_proc answer, then goes on without it
    (failure_mode_allow). Generous: a request that times out loses its routing."""
    lb_policy: str = "RING_HASH"
    """Static fleet only: the model cluster's load balancer (benchmark baselines)."""
    ext_proc_max_concurrent_streams: int = EXT_PROC_MAX_CONCURRENT_STREAMS
    """Streams Envoy opens on one connection to an ext_proc process, then it opens another.
    ext_proc advertises its own limit (``--h2-max-concurrent-streams``, the same default),
    but only once a connection is up: a burst on a new connection would find it unknown."""
    max_downstream_connections: int | None = None
    """Open client connections Envoy keeps; more are closed at once. None: half the
    open-file limit of the process that renders the bootstrap (Envoy's, when it starts
    Envoy), since a request in flight holds a client and an upstream connection."""
    max_heap_bytes: int | None = None
    """Envoy's heap limit (its container's memory limit, less a margin): past 95% of it new
    requests get 503 rather than the process an OOM kill. None: no limit."""
    graceful_close: bool = True
    """Envoy half-closes each ext_proc stream at the request's end instead of resetting it
    (runtime flag ``ext_proc_graceful_grpc_close``; see the bootstrap). Off only to measure."""
    grpc_client_idle_s: int = 7 * 24 * 3600
    """Envoy's ``max_cached_entry_idle_duration``: a worker drops its cached gRPC client
    for the ext_proc cluster after this many seconds without starting a stream. Envoy 1.40
    crashes when a stream outlives that client (see the bootstrap), so the default is far
    above any request; tests set it low (Envoy's minimum is 5) to reproduce the crash."""


def default_max_downstream_connections() -> int:
    """Half the open-file limit Envoy will run with (at least 1,024; 1,000,000 if
    unlimited): the hard limit, as Envoy raises its soft limit to it at start. Container
    runtimes now start processes at a soft limit of 1,024 (containerd 2, Docker 29) under
    a hard one of 524,288: half the soft limit was a cap of 1,024 clients."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return 1_000_000
    return max(1024, hard // 2)


def _static_cluster(
    name: str, hosts: tuple[tuple[str, int], ...], *, http2: bool, max_streams: int | None = None
) -> dict[str, Any]:
    """A fixed cluster of ``hosts``: STATIC for IP literals, STRICT_DNS once any is a name.

    With a name (a compose service, a Kubernetes headless Service) Envoy resolves every
    A/AAAA record and re-resolves periodically, so all replicas behind it are used.
    """
    by_ip = all(is_ip_literal(h) for h, _ in hosts)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if by_ip else "STRICT_DNS",
        "connect_timeout": "0.25s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": h, "port_value": p}}
                            }
                        }
                        for h, p in hosts
                    ]
                }
            ],
        },
    }
    if not by_ip:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if http2:
        options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        cluster["typed_extension_protocol_options"] = {
            options: {
                "@type": f"type.googleapis.com/{options}",
                "explicit_http_config": {
                    "http2_protocol_options": (
                        {} if max_streams is None else {"max_concurrent_streams": max_streams}
                    )
                },
            }
        }
    return cluster


def overload_manager(params: BootstrapParams) -> dict[str, Any]:
    """Envoy's overload manager: the client connection cap, and the heap limit if any."""
    limit = params.max_downstream_connections or default_max_downstream_connections()
    monitors: list[dict[str, Any]] = [
        {
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                "downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": limit,
            },
        }
    ]
    manager: dict[str, Any] = {"resource_monitors": monitors}
    if params.max_heap_bytes is not None:
        heap = "envoy.resource_monitors.fixed_heap"
        monitors.append(
            {
                "name": heap,
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                    "fixed_heap.v3.FixedHeapConfig",
                    "max_heap_size_bytes": params.max_heap_bytes,
                },
            }
        )
        manager["refresh_interval"] = "0.25s"
        manager["actions"] = [
            {
                "name": f"envoy.overload_actions.{action}",
                "triggers": [{"name": heap, "threshold": {"value": threshold}}],
            }
            for action, threshold in (("shrink_heap", 0.90), ("stop_accepting_requests", 0.95))
        ]
    return manager


def _loopback_for(address: str) -> str:
    """Where a process on the same host reaches a listener bound to ``address``."""
    if address in ("0.0.0.0", ""):
        return "127.0.0.1"
    if address == "::":
        return "::1"
    return address


def probe_listener(params: BootstrapParams) -> dict[str, Any] | None:
    """The probe listener: ``GET`` of :data:`PROBE_PATHS` go to the admin interface, the
    rest (``/quitquitquit``, ``/config_dump``, ``/runtime_modify``, ...) gets 404.

    It ignores the overload manager's global connection cap, so the kubelet still sees
    ``/ready`` while clients hold every data-plane connection, and caps its own instead;
    it survives the data plane's ``inboundonly`` drain.
    """
    if params.probe_port is None:
        return None
    hcm = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    limit = "envoy.extensions.filters.network.connection_limit.v3.ConnectionLimit"
    routes: list[dict[str, Any]] = [
        {
            "match": {
                "path": path,
                "headers": [{"name": ":method", "string_match": {"exact": "GET"}}],
            },
            "route": {"cluster": ADMIN_CLUSTER, "timeout": "5s"},
        }
        for path in PROBE_PATHS
    ]
    routes.append(
        {
            "match": {"prefix": "/"},
            "direct_response": {
                "status": 404,
                "body": {"inline_string": f"only GET {' and '.join(PROBE_PATHS)} here\n"},
            },
        }
    )
    return {
        "name": PROBE_LISTENER,
        "address": {
            "socket_address": {"address": params.probe_address, "port_value": params.probe_port}
        },
        "ignore_global_conn_limit": True,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.connection_limit",
                        "typed_config": {
                            "@type": f"type.googleapis.com/{limit}",
                            "stat_prefix": PROBE_LISTENER,
                            "max_connections": PROBE_MAX_CONNECTIONS,
                        },
                    },
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": f"type.googleapis.com/{hcm}",
                            "stat_prefix": PROBE_LISTENER,
                            "stream_idle_timeout": "10s",
                            "request_timeout": "10s",
                            "route_config": {
                                "name": PROBE_LISTENER,
                                "virtual_hosts": [
                                    {"name": PROBE_LISTENER, "domains": ["*"], "routes": routes}
                                ],
                            },
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions"
                                        ".filters.http.router.v3.Router"
                                    },
                                }
                            ],
                        },
                    },
                ]
            }
        ],
    }


def pool_route(config: RouterConfig) -> dict[str, Any]:
    """The route of a pool's request: ext_proc set ``x-prefix-pool`` to the pool's cluster
    (``models/<model>``, :mod:`prefix_router.core.pools`), and asked Envoy to pick the
    route again; the cluster is the header's value, hashed on x-prefix-key as the whole
    fleet's route is. The match admits only pool cluster names, so no header value could
    reach ext_proc's, the xDS or the admin cluster."""
    entry = model_route(config)
    route = entry["route"]
    del route["cluster"]
    route["cluster_header"] = POOL_HEADER
    entry["match"] = {
        "prefix": "/",
        "headers": [{"name": POOL_HEADER, "string_match": {"prefix": POOL_CLUSTER_PREFIX}}],
    }
    return entry


def model_route(config: RouterConfig, *, ext_proc: bool = True) -> dict[str, Any]:
    """The data-plane route: hash on x-prefix-key, never time out a long generation.

    Without ext_proc processes (a baseline for benchmarks) the route turns the filter off.
    """
    route: dict[str, Any] = {
        "cluster": MODEL_CLUSTER,
        "timeout": "0s",
        "hash_policy": [{"header": {"header_name": "x-prefix-key"}}],
    }
    retry = config.retry
    if retry.enabled and retry.num_retries > 0:
        policy: dict[str, Any] = {
            "retry_on": retry.retry_on,
            "num_retries": retry.num_retries,
            # With RING_HASH a retry would hash to the same dead host; this makes Envoy
            # walk on along the ring instead.
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host"
                        ".previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 8,
        }
        if retry.per_try_timeout_ms:
            policy["per_try_timeout"] = f"{retry.per_try_timeout_ms / 1000:.3f}s"
        route["retry_policy"] = policy
    entry: dict[str, Any] = {"match": {"prefix": "/"}, "route": route}
    if not ext_proc:
        per_route = "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
        entry["typed_per_filter_config"] = {
            "envoy.filters.http.ext_proc": {
                "@type": f"type.googleapis.com/{per_route}",
                "disabled": True,
            }
        }
    return entry


def render_bootstrap(
    params: BootstrapParams, config: RouterConfig, fleet: Fleet | None = None
) -> str:
    """The bootstrap YAML. ``fleet`` is required for a static fleet, ignored with xDS."""
    if params.grpc_client_idle_s < MIN_GRPC_CLIENT_IDLE_S:
        raise ConfigError(
            f"grpc_client_idle_s must be at least {MIN_GRPC_CLIENT_IDLE_S} (Envoy's minimum), "
            f"got {params.grpc_client_idle_s}"
        )
    ext_proc = _static_cluster(
        EXT_PROC_CLUSTER,
        params.ext_proc,
        http2=True,
        max_streams=params.ext_proc_max_concurrent_streams,
    )
    ext_proc["circuit_breakers"] = circuit_breakers(config)
    clusters = [ext_proc]
    probes = probe_listener(params)
    if probes is not None:
        admin = (_loopback_for(params.admin_address), params.admin_port)
        clusters.append(_static_cluster(ADMIN_CLUSTER, (admin,), http2=False))
    dynamic = ""
    if params.xds is not None:
        xds = _static_cluster(XDS_CLUSTER, (params.xds,), http2=True)
        # PINGs on the ADS connection: the control plane only pushes, so a peer gone with
        # its node (no FIN, no RST) would otherwise go unnoticed and the fleet freeze.
        options = next(iter(xds["typed_extension_protocol_options"].values()))
        options["explicit_http_config"]["http2_protocol_options"]["connection_keepalive"] = {
            "interval": XDS_KEEPALIVE_INTERVAL,
            "timeout": XDS_KEEPALIVE_TIMEOUT,
        }
        clusters.append(xds)
        dynamic = "dynamic_resources:\n" + json.dumps(
            {
                "ads_config": {
                    "api_type": "GRPC",
                    "transport_api_version": "V3",
                    "grpc_services": [
                        {
                            "envoy_grpc": {
                                "cluster_name": XDS_CLUSTER,
                                # Reconnect to a restarted control plane within ~2 s
                                # (Envoy's default backoff grows to 30 s).
                                "retry_policy": {
                                    "retry_back_off": {
                                        "base_interval": "0.25s",
                                        "max_interval": "2s",
                                    }
                                },
                            }
                        }
                    ],
                    "set_node_on_first_message_only": True,
                },
                "cds_config": {"ads": {}, "resource_api_version": "V3"},
            },
            indent=None,
        ).join(["  ", "\n"])
    else:
        if fleet is None:
            raise ValueError("a static bootstrap needs the fleet")
        addresses = resolve_now(names_in(fleet))
        clusters += model_clusters(
            config, fleet, eds=False, lb_policy=params.lb_policy, addresses=addresses
        )
    template = Template(template_path().read_text())
    return template.substitute(
        node_id=params.node_id,
        admin_address=params.admin_address,
        admin_port=params.admin_port,
        listen_address=params.listen_address,
        listen_port=params.listen_port,
        body_buffer_bytes=params.body_buffer_bytes,
        max_body_bytes=params.max_body_bytes,
        max_body_bytes_plus_one=params.max_body_bytes + 1,
        ext_proc_timeout=f"{params.ext_proc_timeout_ms / 1000:.3f}s",
        overload_manager_json=json.dumps(overload_manager(params)),
        route_json=json.dumps(model_route(config, ext_proc=bool(params.ext_proc))),
        pool_route_json=json.dumps(pool_route(config)),
        static_clusters_json=json.dumps(clusters),
        probe_listener="" if probes is None else f"  - {json.dumps(probes)}",
        dynamic_resources=dynamic,
        grpc_client_idle=f"{params.grpc_client_idle_s}s",
        graceful_close="true" if params.graceful_close else "false",
    )
