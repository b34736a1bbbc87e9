"""Follow the control plane's shared state in Redis: fleet + config -> a new routing table.

With ``--redis-url``, ext_proc takes its fleet and config from the Redis
documents the control plane writes (``prefix_router.state.store``), not from flags.
Each time a version moves, a new :class:`~prefix_router.core.table.RoutingTable`
is built from exactly what the control plane publishes to Envoy (the same
fleet in the same order; routable = active and healthy, draining excluded), so
the ring mirror is Envoy's ring, and swapped in whole. A change arrives by
pub/sub at once and by a periodic re-read (``interval``) at worst.

The build runs in a thread (:class:`TableBuilder`): its rings are 256 hashes per unit of
weight and a sort, 14 ms for 64 instances of weight 1 but 160 ms at weight 8 and most of a
second at 32, which on the event loop would hold every request past Envoy's message
timeout. In a thread the loop keeps its turns (the interpreter switches every 5 ms), and
the newest state wanted is the one built next; one older never replaces it.
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


def use_table(router: RequestRouter, table: RoutingTable) -> None:
    """Swap in ``table``, and its config's bound on a Redis round trip (the store was made
    with the start-up config's)."""
    router.use(table)
    if isinstance(router.store, RedisStore):
        router.store.round_trip_timeout_s = table.config.redis_timeout_ms / 1000
    log.info(
        "routing table: fleet v%d (%d routable), config v%d",
        table.fleet_version,
        len(table.ids),
        table.config_version,
    )


REBUILD_AFTER_S = 1.0
"""A table that failed to build is built again this long after (the watch, which sees
the version applied, would not ask again until the next change)."""


class TableBuilder:
    """Builds each wanted table in a thread, the newest wanted next, and swaps it in."""

    def __init__(self, router: RequestRouter) -> None:
        self.router = router
        self._wanted: tuple[Fleet, RouterConfig, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def want(self, fleet: Fleet, config: RouterConfig, version: int) -> None:
        self._wanted = (fleet, config, version)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._build())

    async def settled(self) -> None:
        """Wait until every table wanted so far is in use."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _build(self) -> None:
        while self._wanted is not None:
            wanted = self._wanted
            self._wanted = None
            fleet, config, version = wanted
            try:
                table = await asyncio.to_thread(
                    RoutingTable.build, fleet, config, config_version=version
                )
            except Exception:  # the state is the control plane's, checked there: log it
                log.exception("cannot build the routing table of fleet v%d", fleet.version)
                if self._wanted is None:  # nothing newer wanted: try this one again
                    self._wanted = wanted
                    await asyncio.sleep(REBUILD_AFTER_S)
                continue
            use_table(self.router, table)


async def follow_state(
    router: RequestRouter,
    redis_url: str,
    namespace: str,
    *,
    stop: asyncio.Event,
    interval: float = WATCH_INTERVAL_S,
) -> None:
    """Keep ``router``'s table on the shared state until ``stop`` is set."""
    builder = TableBuilder(router)
    try:
        await watch_state(redis_url, namespace, builder.want, interval=interval, stop=stop)
    finally:
        await builder.settled()
