"""Follow the control plane's shared state in Redis: fleet + config -> a new routing table.

With ``--redis-url``, ext_proc takes its fleet and config from the Redis
documents the control plane writes (``prefix_router.state.store``), not from flags.
Each time a version moves, a new :class:`~prefix_router.core.table.RoutingTable`
is built from exactly what the control plane publishes to Envoy (the same
fleet in the same order; routable = active and healthy, draining excluded), so
the ring mirror is Envoy's ring, and swapped in whole. A change arrives by
pub/sub at once and by a periodic re-read (``interval``) at worst.
"""

from __future__ import annotations

import asyncio
import logging

from ext_proc.router import RequestRouter
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet
from prefix_router.core.table import RoutingTable
from prefix_router.state.routing.redis_store import RedisStore
from prefix_router.state.store import WATCH_INTERVAL_S, watch_state

log = logging.getLogger("prefix_router.ext_proc")


def apply_state(router: RequestRouter, fleet: Fleet, config: RouterConfig, version: int) -> None:
    """Swap in the routing table of this fleet and config, and the config's bound on a
    Redis round trip (the store was made with the start-up config's)."""
    router.use(RoutingTable.build(fleet, config, config_version=version))
    if isinstance(router.store, RedisStore):
        router.store.round_trip_timeout_s = config.redis_timeout_ms / 1000
    log.info(
        "routing table: fleet v%d (%d routable), config v%d",
        fleet.version,
        len(fleet.routable),
        version,
    )


async def follow_state(
    router: RequestRouter,
    redis_url: str,
    namespace: str,
    *,
    stop: asyncio.Event,
    interval: float = WATCH_INTERVAL_S,
) -> None:
    """Keep ``router``'s table on the shared state until ``stop`` is set."""

    def on_change(fleet: Fleet, config: RouterConfig, version: int) -> None:
        apply_state(router, fleet, config, version)

    await watch_state(redis_url, namespace, on_change, interval=interval, stop=stop)
