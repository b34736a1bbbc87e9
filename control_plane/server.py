"""Control-plane process: xDS (ADS) on one port, the admin API on another, one event loop.

``main(argv)`` is ``prefix-router control-plane``. Start-up:

1. seed Redis from ``--fleet`` / ``--config`` where the namespace is empty
   (Redis is the source of truth: a restart comes back with the live state);
2. follow the shared state (pub/sub + periodic re-read) and publish one
   checked snapshot per version to every Envoy over ADS; write it back if
   Redis loses it (restarted empty: ``control_plane.restore``);
3. run the drainer, the health probe, the fleet view (each instance's
   vLLM ``/metrics``, every ``--fleet-scrape-interval`` seconds) and, with
   ``--discover-models``, model discovery (each instance's ``/v1/models``);
4. serve the admin API (uvicorn; also ``/metrics``, ``/fleet`` and the status
   page ``/ui``) and gRPC health on the xDS port.

The admin token comes from ``PREFIX_ROUTER_ADMIN_TOKEN`` or ``--token-file``;
without one the process refuses to start unless the admin API is bound to a
loopback address. SIGTERM/SIGINT stop everything gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import math
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
import yaml
from envoy.service.discovery.v3 import ads_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from control_plane.admin import create_app, create_metrics_app
from control_plane.ads import AdsServer
from control_plane.cache import SnapshotCache
from control_plane.callbacks import ClientRegistry
from control_plane.drain import Drainer
from control_plane.fleet_view import FleetView
from control_plane.health import HealthProber
from control_plane.http_server import MAX_CONNECTIONS, server_config
from control_plane.models import ModelDiscovery
from control_plane.publisher import Publisher, keep_names_resolved
from control_plane.restore import StateKeeper
from control_plane.service import AdminService
from control_plane.xds_limits import XdsLimits, xds_grpc_server
from prefix_router.core.config import RouterConfig, load_config_file, parse_config
from prefix_router.core.errors import ConfigError, FleetError, StartupError
from prefix_router.core.fleet import INSTANCE_API_KEY_ENV, Fleet, fleet_from_file
from prefix_router.logs import setup_logging
from prefix_router.state.clock import CLOCK_SCALE_HELP, parse_clock_scale, scaled_clock
from prefix_router.state.redis_url import resolve_redis_url
from prefix_router.state.store import DEFAULT_NAMESPACE, StateStore, watch_state

log = logging.getLogger("prefix_router.control_plane")

TOKEN_ENV = "PREFIX_ROUTER_ADMIN_TOKEN"
"""The variable the admin API's bearer token is read from (else --token-file)."""
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    xds_host: str = "127.0.0.1"
    xds_port: int
    admin_host: str = "127.0.0.1"
    admin_port: int
    metrics_port: int | None = None
    """``/metrics`` and ``/healthz`` on a port of their own too (on ``admin_host``)."""
    redis_url: str
    namespace: str = DEFAULT_NAMESPACE
    fleet: Fleet | None = None
    config: RouterConfig | None = None
    token: str | None = None
    drain_grace_s: float = 2.0
    drain_timeout_s: float = 300.0
    watch_interval_s: float = 1.0
    health_probe: bool = True
    fleet_scrape_interval_s: float = 2.0
    """0 turns the fleet view's scraping off (state and loads are still read on request)."""
    fleet_window_s: float = 60.0
    fleet_scrape_timeout_s: float = 1.0
    fleet_metrics_path: str = "/metrics"
    model_discovery: bool = False
    """Learn each instance's models from its ``GET /v1/models`` (control_plane/models.py)."""
    model_discovery_interval_s: float = 2.0
    instance_api_key: str | None = None
    """Sent as a bearer token to the instances' ``/v1/models`` (vLLM's ``--api-key``)."""
    clock_scale: float = 1.0
    """The instances' seconds per wall second (a simulated fleet's time scale): the fleet
    view's windows, and so the prefill rates it learns, are in the instances' seconds."""
    xds_limits: XdsLimits = XdsLimits()
    """Limits on every peer of the xDS port (control_plane/xds_limits.py)."""
    http_max_connections: int = MAX_CONNECTIONS
    """Connections the admin port, and the metrics port, each hold at once
    (control_plane/http_server.py)."""


def load_fleet_file(path: str) -> tuple[Fleet, RouterConfig | None]:
    """``instances: [{address, port, weight, models, hash_key}]`` plus optional ``routing:``."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read fleet file {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("instances", []), list):
        raise ConfigError(f"fleet file {path}: expected a mapping with an 'instances' list")
    try:
        fleet = fleet_from_file(data.get("instances") or [])
    except FleetError as exc:
        raise ConfigError(f"fleet file {path}: {exc}") from None
    routing = data.get("routing")
    return fleet, (parse_config(routing) if routing is not None else None)


def resolve_token(token_file: str | None, admin_host: str) -> str | None:
    token = os.environ.get(TOKEN_ENV) or None
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip() or None
        except OSError as exc:
            raise StartupError(f"cannot read --token-file {token_file}: {exc}") from None
    if token is None and not _is_loopback(admin_host):
        raise StartupError(
            f"admin API on {admin_host} needs a token: set {TOKEN_ENV} or --token-file "
            "(only a loopback address may run without one)"
        )
    return token


def resolve_instance_api_key(key_file: str | None) -> str | None:
    """The instances' API key: from ``key_file`` (a mounted Secret), else the environment."""
    if key_file:
        try:
            with open(key_file) as f:
                return f.read().strip() or None
        except OSError as exc:
            raise StartupError(f"cannot read --instance-api-key-file {key_file}: {exc}") from None
    return os.environ.get(INSTANCE_API_KEY_ENV) or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: this process owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run(settings: Settings, stop: asyncio.Event) -> None:
    store = StateStore.from_url(settings.redis_url, settings.namespace)
    state = await store.seed(settings.fleet, settings.config or RouterConfig())
    log.info("shared state: fleet v%d, config v%d", *state.versions)

    cache = SnapshotCache()
    clients = ClientRegistry()
    publisher = Publisher(cache)
    view = FleetView(
        store,
        interval_s=settings.fleet_scrape_interval_s,
        window_s=settings.fleet_window_s,
        timeout_s=settings.fleet_scrape_timeout_s,
        metrics_path=settings.fleet_metrics_path,
        clock=scaled_clock(settings.clock_scale),
    )
    service = AdminService(
        store,
        store,
        clients=clients,
        published_version=lambda: publisher.published.version if publisher.published else None,
        view=view,
    )

    grpc_server = xds_grpc_server(settings.xds_limits)
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
        AdsServer(cache, clients), grpc_server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    if grpc_server.add_insecure_port(f"{settings.xds_host}:{settings.xds_port}") == 0:
        raise StartupError(f"cannot bind xDS on {settings.xds_host}:{settings.xds_port}")

    admin = _EmbeddedUvicorn(
        server_config(
            create_app(service, token=settings.token),
            settings.admin_host,
            settings.admin_port,
            name="admin",
            max_connections=settings.http_max_connections,
        )
    )
    metrics_server = (
        None
        if settings.metrics_port is None
        else _EmbeddedUvicorn(
            server_config(
                create_metrics_app(service),
                settings.admin_host,
                settings.metrics_port,
                name="metrics",
                max_connections=settings.http_max_connections,
            )
        )
    )
    prober = HealthProber(store)
    drainer = Drainer(
        store, store, grace_s=settings.drain_grace_s, timeout_s=settings.drain_timeout_s
    )
    tasks: list[asyncio.Task[Any]] = [
        asyncio.create_task(
            watch_state(
                settings.redis_url,
                settings.namespace,
                publisher.on_state,
                interval=settings.watch_interval_s,
                stop=stop,
            ),
            name="watch_state",
        ),
        asyncio.create_task(drainer.run(stop), name="drainer"),
        asyncio.create_task(
            StateKeeper(store, interval_s=settings.watch_interval_s).run(stop), name="state-keeper"
        ),
        asyncio.create_task(keep_names_resolved(publisher, stop), name="resolve_names"),
    ]
    if settings.health_probe:
        tasks.append(asyncio.create_task(prober.run(stop), name="health"))
    if settings.fleet_scrape_interval_s > 0:
        tasks.append(asyncio.create_task(view.run(stop), name="fleet-view"))
    if settings.model_discovery:
        discovery = ModelDiscovery(
            store,
            interval_s=settings.model_discovery_interval_s,
            api_key=settings.instance_api_key,
        )
        tasks.append(asyncio.create_task(discovery.run(stop), name="model-discovery"))
    await grpc_server.start()
    for name in ("", ADS_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    admin_task = asyncio.create_task(admin.serve(), name="admin")
    servers: dict[asyncio.Task[Any], tuple[_EmbeddedUvicorn, int, str]] = {
        admin_task: (admin, settings.admin_port, "admin API")
    }
    if metrics_server is not None and settings.metrics_port is not None:
        metrics_task = asyncio.create_task(metrics_server.serve(), name="metrics")
        servers[metrics_task] = (metrics_server, settings.metrics_port, "metrics")
    log.info(
        "control plane: xDS on %s:%d, admin API on %s:%d (%s)",
        settings.xds_host,
        settings.xds_port,
        settings.admin_host,
        settings.admin_port,
        "token auth" if settings.token else "no auth: loopback only",
    )
    try:
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({stopped, *servers}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task in servers and not servers[task][0].started:
                _, port, what = servers[task]
                raise StartupError(f"{what} could not start on {settings.admin_host}:{port}")
    finally:
        stop.set()
        for name in ("", ADS_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for server, _, _ in servers.values():
            server.should_exit = True
        await grpc_server.stop(grace=1.0)
        await asyncio.gather(*servers, *tasks, return_exceptions=True)
        await prober.close()
        await view.close()
        await store.close()
        log.info("control plane stopped")


XDS_LIMIT_FLAGS: dict[str, tuple[type[int] | type[float], str]] = {
    "max_connections": (
        int,
        "connections the xDS port holds at once; one more is closed as it is accepted",
    ),
    "max_streams_per_connection": (
        int,
        "streams at once on one xDS connection (an Envoy uses one)",
    ),
    "max_calls": (int, "calls at once on the xDS port; one more is refused (RESOURCE_EXHAUSTED)"),
    "handshake_timeout_s": (float, "seconds a new xDS connection has to finish HTTP/2's handshake"),
    "idle_timeout_s": (float, "seconds an xDS connection with no call open is kept"),
}
"""The fields of :class:`XdsLimits` that are flags (``--xds-...``), with their types and help."""


def _xds_flag(field: str) -> str:
    """``max_streams_per_connection`` -> ``--xds-max-streams``, ``handshake_timeout_s`` ->
    ``--xds-handshake-timeout``."""
    name = field.removesuffix("_s").removesuffix("_per_connection")
    return "--xds-" + name.replace("_", "-")


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a whole number at least 1 (``int``) or a positive, finite number
    (``float``), so a bad value is refused by its flag's name before anything starts."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'whole ' if kind is int else ''}number, got {text!r}"
            ) from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(
                f"must be {'at least 1' if kind is int else 'positive'}, got {text}"
            )
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix-router control-plane", description=__doc__)
    p.add_argument("--xds-host", default="127.0.0.1")
    p.add_argument("--xds-port", type=int, default=18000)
    p.add_argument("--admin-host", default="127.0.0.1")
    p.add_argument("--admin-port", type=int, default=18001)
    p.add_argument(
        "--metrics-port",
        type=int,
        help="also serve /metrics and /healthz (no auth) on this port, on --admin-host",
    )
    p.add_argument(
        "--http-max-connections",
        type=_positive(int),
        default=MAX_CONNECTIONS,
        help="connections the admin port (and the metrics port) each hold at once; one more "
        "evicts the connection nearest its request-head deadline, or is closed when every "
        "connection has a request in progress",
    )
    p.add_argument("--redis-url", help=f"shared state (default {DEFAULT_REDIS_URL})")
    p.add_argument(
        "--redis-url-file",
        help="read the Redis URL from this file (a mounted Secret: keeps a password out of ps)",
    )
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Redis key prefix")
    p.add_argument("--fleet", help="YAML: instances: [...], optional routing: {...}")
    p.add_argument("--config", help="YAML routing config (wins over the fleet file's)")
    p.add_argument("--token-file", help=f"admin bearer token (else ${TOKEN_ENV})")
    p.add_argument("--drain-grace", type=float, default=2.0, help="min seconds draining")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="max seconds draining")
    p.add_argument("--no-health-probe", action="store_true", help="leave health to Envoy alone")
    p.add_argument(
        "--fleet-scrape-interval",
        type=float,
        default=2.0,
        help="seconds between reads of every instance's /metrics (0: off)",
    )
    p.add_argument(
        "--fleet-window",
        type=float,
        default=60.0,
        help="seconds over which hit rate, TTFT and affinity are computed",
    )
    p.add_argument(
        "--fleet-scrape-timeout",
        type=float,
        default=1.0,
        help="seconds one instance's /metrics may take",
    )
    p.add_argument("--fleet-metrics-path", default="/metrics", help="instances' metrics path")
    p.add_argument(
        "--discover-models",
        action="store_true",
        help="learn each instance's models (base and LoRA adapters) from its GET /v1/models; "
        "declared models take precedence",
    )
    p.add_argument(
        "--model-discovery-interval",
        type=float,
        default=2.0,
        help="seconds between two rounds of model discovery",
    )
    p.add_argument(
        "--instance-api-key-file",
        help=f"the API key the instances run with (vLLM's --api-key), for model discovery "
        f"(else ${INSTANCE_API_KEY_ENV})",
    )
    p.add_argument("--clock-scale", type=parse_clock_scale, default=1.0, help=CLOCK_SCALE_HELP)
    limits = XdsLimits()
    for field, (kind, help_) in XDS_LIMIT_FLAGS.items():
        p.add_argument(
            _xds_flag(field), type=_positive(kind), default=getattr(limits, field), help=help_
        )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    xds_limits = XdsLimits(
        **{
            field: getattr(args, _xds_flag(field)[2:].replace("-", "_"))
            for field in XDS_LIMIT_FLAGS
        }
    )
    setup_logging("control_plane", args.log_level)
    fleet, config = load_fleet_file(args.fleet) if args.fleet else (None, None)
    if args.config:
        config = load_config_file(args.config)
    settings = Settings(
        xds_host=args.xds_host,
        xds_port=args.xds_port,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        metrics_port=args.metrics_port,
        redis_url=resolve_redis_url(args.redis_url, args.redis_url_file) or DEFAULT_REDIS_URL,
        namespace=args.namespace,
        fleet=fleet,
        config=config,
        token=resolve_token(args.token_file, args.admin_host),
        drain_grace_s=args.drain_grace,
        drain_timeout_s=args.drain_timeout,
        health_probe=not args.no_health_probe,
        fleet_scrape_interval_s=args.fleet_scrape_interval,
        fleet_window_s=args.fleet_window,
        fleet_scrape_timeout_s=args.fleet_scrape_timeout,
        fleet_metrics_path=args.fleet_metrics_path,
        model_discovery=args.discover_models,
        model_discovery_interval_s=args.model_discovery_interval,
        instance_api_key=resolve_instance_api_key(args.instance_api_key_file),
        clock_scale=args.clock_scale,
        xds_limits=xds_limits,
        http_max_connections=args.http_max_connections,
    )

    async def main_async() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, stop)

    asyncio.run(main_async())
    return 0
