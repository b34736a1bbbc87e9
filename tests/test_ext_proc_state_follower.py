"""ext_proc follows the shared state: a config change reaches the routing store too."""

from __future__ import annotations

from ext_proc.router import RequestRouter
from ext_proc.state_follower import apply_state
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.table import RoutingTable
from prefix_router.state.routing.redis_store import RedisStore
from tests.conftest import REDIS_URL

FLEET = Fleet.of([Instance("10.0.0.1", 8000), Instance("10.0.0.2", 8000)], version=1)


async def test_a_new_redis_timeout_bounds_the_stores_round_trips(namespace: str) -> None:
    """The store is made with the start-up config's ``redis_timeout_ms``; the one the
    control plane publishes later is what bounds its round trips (configuration.md: routing
    settings change live)."""
    store = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=0.1)
    try:
        router = RequestRouter(RoutingTable.build(FLEET, RouterConfig()), store)
        apply_state(router, FLEET, RouterConfig(redis_timeout_ms=750), version=2)
        assert store.round_trip_timeout_s == 0.75
        assert router.table.config.redis_timeout_ms == 750
    finally:
        await store.close()
