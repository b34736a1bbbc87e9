"""ext_proc process: gRPC server, health service, routing-table updates, shutdown.

``main(argv)`` is ``prefix-router ext-proc``. The fleet and config come either
from flags (a static fleet) or from the control plane's state in Redis
(``--redis-url``), which this process follows live.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from ext_proc.metrics import PrometheusCallbacks
from ext_proc.router import RequestRouter
from ext_proc.servicer import ExternalProcessor
from ext_proc.state_follower import follow_state
from prefix_router.config import RouterConfig, load_config_file
from prefix_router.fleet import Fleet, Instance
from prefix_router.loads import InMemoryLoadStore, LoadStore
from prefix_router.loads.redis_store import RedisLoadStore
from prefix_router.logs import setup_logging
from prefix_router.routing import RoutingTable

log = logging.getLogger("prefix_router.ext_proc")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


async def serve(
    router: RequestRouter,
    *,
    host: str = "127.0.0.1",
    port: int,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve ext_proc (and gRPC health) on ``host:port`` until ``stop`` is set."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    )
    servicer = ExternalProcessor(router)
    if isinstance(router.callbacks, PrometheusCallbacks):
        loop = asyncio.get_running_loop()
        router.callbacks.open_streams.set_function(lambda: servicer.open_streams)
        router.callbacks.asyncio_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"ext_proc cannot bind {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("ext_proc serving on %s:%d", host, port)
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=2.0)
        log.info("ext_proc stopped")


async def _load_store(redis_url: str | None, namespace: str, config: RouterConfig) -> LoadStore:
    """Fleet-wide counts in Redis when given one, else this process's own counts."""
    if redis_url is None:
        return InMemoryLoadStore()
    return await RedisLoadStore.connect(
        redis_url, namespace=namespace, timeout_s=config.redis_timeout_ms / 1000
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix-router ext-proc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", action="append", default=[], help="host:port (static fleet)")
    p.add_argument("--config", help="YAML file with the routing config")
    p.add_argument("--redis-url", help="share in-flight counts (and follow the fleet) in Redis")
    p.add_argument("--namespace", default="prefix-router:", help="Redis key prefix")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging("ext_proc", args.log_level)
    config = load_config_file(args.config) if args.config else RouterConfig()
    fleet = Fleet.of([Instance.from_url(b) for b in args.backend])

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        store = await _load_store(args.redis_url, args.namespace, config)
        callbacks = PrometheusCallbacks()
        if args.metrics_port:
            start_http_server(args.metrics_port, addr=args.host, registry=callbacks.registry)
        router = RequestRouter(RoutingTable.build(fleet, config), store, callbacks)
        follower = None
        if args.redis_url and not args.backend:  # no static fleet: follow the control plane's
            follower = asyncio.create_task(
                follow_state(router, args.redis_url, args.namespace, stop=stop)
            )
        try:
            await serve(router, host=args.host, port=args.port, stop=stop)
        finally:
            if follower is not None:
                await follower
            await store.close()

    asyncio.run(run())
    return 0
