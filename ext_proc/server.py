"""ext_proc process: gRPC server, health service, routing-table updates, shutdown.

``main(argv)`` is ``prefix-router ext-proc``. The fleet and config come either
from flags (a static fleet) or from the control plane's state in Redis
(``--redis-url`` or ``--redis-url-file``), which this process follows live.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

import uvloop

from ext_proc.grpcio_server import GrpcioExtProcServer
from ext_proc.http2.grpc_server import GrpcServer
from ext_proc.http2.health import CHECK_PATH, HealthStatus
from ext_proc.http2.limits import PeerLimits, add_flags, limits_from_args
from ext_proc.metrics import PrometheusCallbacks
from ext_proc.metrics_server import serve_metrics
from ext_proc.router import RequestRouter
from ext_proc.servicer import PROCESS_PATH, SERVICE_NAME, ExternalProcessor
from ext_proc.state_follower import follow_state
from prefix_router.core.config import RouterConfig, load_config_file
from prefix_router.core.fleet import fleet_from_urls
from prefix_router.core.table import RoutingTable
from prefix_router.envoy.bootstrap import DEFAULT_EXT_PROC_TIMEOUT_MS
from prefix_router.logs import setup_logging
from prefix_router.state.clock import CLOCK_SCALE_HELP, parse_clock_scale
from prefix_router.state.redis_url import resolve_redis_url
from prefix_router.state.routing import RoutingStore
from prefix_router.state.routing.redis_store import RedisStore

log = logging.getLogger("prefix_router.ext_proc")


class Transport(StrEnum):
    """The gRPC server that carries ext_proc's streams."""

    HTTP2 = "http2"
    """Our gRPC layer on libnghttp2 and the event loop (``ext_proc.http2``): the default."""
    GRPCIO = "grpcio"
    """grpcio's asyncio server: several times the CPU a request; the fallback."""


class ExtProcServer(Protocol):
    async def start(self, host: str, port: int) -> None: ...
    async def set_serving(self, serving: bool) -> None: ...
    async def stop(self, grace: float) -> None: ...


class Http2ExtProcServer:
    """ext_proc and the gRPC health service on :class:`~ext_proc.http2.grpc_server.GrpcServer`."""

    def __init__(self, processor: ExternalProcessor, limits: PeerLimits | None = None) -> None:
        self._health = HealthStatus((SERVICE_NAME,))
        callbacks = processor.router.callbacks
        self._server = GrpcServer(
            {PROCESS_PATH: processor.open, CHECK_PATH: self._health.check_method()},
            limits,
            on_breach=(
                callbacks.on_http2_breach if isinstance(callbacks, PrometheusCallbacks) else None
            ),
        )
        if isinstance(callbacks, PrometheusCallbacks):
            callbacks.http2_connections.set_function(lambda: self._server.connections)
            callbacks.http2_partial_bytes.set_function(lambda: self._server.partial_bytes)

    async def start(self, host: str, port: int) -> None:
        await self._server.start(host, port)

    async def set_serving(self, serving: bool) -> None:
        self._health.set_serving(serving)

    async def stop(self, grace: float) -> None:
        await self._server.stop(grace)


async def serve(
    router: RequestRouter,
    *,
    host: str = "127.0.0.1",
    port: int,
    stop: asyncio.Event | None = None,
    transport: Transport = Transport.HTTP2,
    limits: PeerLimits | None = None,
) -> None:
    """Serve ext_proc (and gRPC health) on ``host:port`` until ``stop`` is set."""
    processor = ExternalProcessor(router)
    if isinstance(router.callbacks, PrometheusCallbacks):
        loop = asyncio.get_running_loop()
        router.callbacks.open_streams.set_function(lambda: processor.open_streams)
        router.callbacks.asyncio_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))
        store = router.store
        if isinstance(store, RedisStore):
            router.callbacks.watch_store(
                lambda: (store.decided_at_once, store.decided_after_round_trip)
            )
    server: ExtProcServer = (
        Http2ExtProcServer(processor, limits)
        if transport is Transport.HTTP2
        else GrpcioExtProcServer(processor, limits)
    )
    await server.start(host, port)
    await server.set_serving(True)
    log.info("ext_proc serving on %s:%d (%s)", host, port, transport.value)
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        await server.set_serving(False)
        await server.stop(grace=2.0)
        log.info("ext_proc stopped")


async def _routing_store(
    redis_url: str | None, namespace: str, config: RouterConfig, clock_scale: float = 1.0
) -> RoutingStore | None:
    """The fleet's routing state in Redis when given one; None: this replica routes alone."""
    if redis_url is None:
        return None
    return await RedisStore.connect(
        redis_url,
        namespace=namespace,
        timeout_s=config.redis_timeout_ms / 1000,
        clock_scale=clock_scale,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix-router ext-proc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", action="append", default=[], help="host:port (static fleet)")
    p.add_argument("--config", help="YAML file with the routing config")
    p.add_argument("--redis-url", help="share the routing state (and follow the fleet) in Redis")
    p.add_argument(
        "--redis-url-file",
        help="read the Redis URL from this file (a mounted Secret: keeps a password out of ps)",
    )
    p.add_argument("--namespace", default="prefix-router:", help="Redis key prefix")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--metrics-host",
        help="address of the metrics port (default: --host; 0.0.0.0 lets Prometheus in while "
        "the gRPC port stays on 127.0.0.1)",
    )
    p.add_argument(
        "--transport",
        type=Transport,
        choices=list(Transport),
        default=Transport.HTTP2,
        help="gRPC server: our HTTP/2 (default) or grpcio (the fallback)",
    )
    p.add_argument(
        "--clock-scale",
        type=parse_clock_scale,
        default=1.0,
        help=CLOCK_SCALE_HELP,
    )
    p.add_argument(
        "--envoy-timeout-ms",
        type=float,
        default=DEFAULT_EXT_PROC_TIMEOUT_MS,
        help="Envoy's ext_proc message timeout (the bootstrap's --ext-proc-timeout-ms): a "
        "request waits on Redis at most 80%% of it, then is decided on this replica's state",
    )
    p.add_argument("--log-level", default="INFO")
    add_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.redis_url = resolve_redis_url(args.redis_url, args.redis_url_file)
    try:
        limits = limits_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging("ext_proc", args.log_level)
    config = load_config_file(args.config) if args.config else RouterConfig()
    fleet = fleet_from_urls(args.backend)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        store = await _routing_store(args.redis_url, args.namespace, config, args.clock_scale)
        callbacks = PrometheusCallbacks()
        if args.metrics_port:
            serve_metrics(
                args.metrics_port,
                args.metrics_host or args.host,
                callbacks.registry,
                on_refused=callbacks.metrics_refused.inc,
            )
        router = RequestRouter(
            RoutingTable.build(fleet, config),
            store,
            callbacks,
            clock_scale=args.clock_scale,
            envoy_timeout_ms=args.envoy_timeout_ms,
        )
        follower = None
        if args.redis_url and not args.backend:  # no static fleet: follow the control plane's
            follower = asyncio.create_task(
                follow_state(router, args.redis_url, args.namespace, stop=stop)
            )
        try:
            await serve(
                router,
                host=args.host,
                port=args.port,
                stop=stop,
                transport=args.transport,
                limits=limits,
            )
        finally:
            stop.set()  # the server may have failed to start (its port taken): end the follower
            if follower is not None:
                await follower
            await router.store.close()

    if args.transport is Transport.HTTP2:
        uvloop.run(run())  # grpcio's asyncio server does not run on uvloop
    else:
        asyncio.run(run())
    return 0
