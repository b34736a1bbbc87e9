"""ext_proc follows the shared state: a config change reaches the routing store too."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ext_proc import state_follower
from ext_proc.router import RequestRouter
from ext_proc.state_follower import TableBuilder, use_table
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.table import RoutingTable
from prefix_router.state.routing import InProcessStore
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
        use_table(router, RoutingTable.build(FLEET, RouterConfig(redis_timeout_ms=750)))
        assert store.round_trip_timeout_s == 0.75
        assert router.table.config.redis_timeout_ms == 750
    finally:
        await store.close()


async def test_tables_are_built_off_the_loop_and_the_newest_wanted_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A big fleet's rings take a good part of a second to build: the loop keeps serving
    meanwhile (the old table routes until the new one is ready), and of states wanted one
    after another the newest is the one in use at the end, never an older one after it."""
    router = RequestRouter(RoutingTable.build(FLEET, RouterConfig()), InProcessStore())
    real_build = RoutingTable.build
    release = threading.Event()

    def held_build(fleet: Fleet, config: RouterConfig, *, config_version: int = 0) -> RoutingTable:
        if fleet.version == 2:  # the big one: held until the test has seen the loop turn
            assert release.wait(30)
        return real_build(fleet, config, config_version=config_version)

    monkeypatch.setattr(RoutingTable, "build", held_build)
    builder = TableBuilder(router)
    builder.want(Fleet.of(list(FLEET.instances), version=2), RouterConfig(), 1)
    for _ in range(3):
        await asyncio.sleep(0)  # the loop turns while the build is held
    assert router.table.fleet_version == 1
    builder.want(Fleet.of(list(FLEET.instances), version=3), RouterConfig(), 1)
    builder.want(Fleet.of(list(FLEET.instances), version=4), RouterConfig(), 2)
    release.set()
    await builder.settled()
    assert (router.table.fleet_version, router.table.config_version) == (4, 2)


async def test_a_table_that_failed_to_build_is_built_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch takes a state as applied once handed over; a build that fails (once) is
    tried again, instead of the old table routing until the next change."""
    router = RequestRouter(RoutingTable.build(FLEET, RouterConfig()), InProcessStore())
    real_build = RoutingTable.build
    failures = [MemoryError("once")]

    def flaky_build(fleet: Fleet, config: RouterConfig, *, config_version: int = 0) -> RoutingTable:
        if failures:
            raise failures.pop()
        return real_build(fleet, config, config_version=config_version)

    monkeypatch.setattr(RoutingTable, "build", flaky_build)
    monkeypatch.setattr(state_follower, "REBUILD_AFTER_S", 0.01)
    builder = TableBuilder(router)
    builder.want(Fleet.of(list(FLEET.instances), version=2), RouterConfig(), 1)
    await asyncio.wait_for(builder.settled(), 10)
    assert router.table.fleet_version == 2 and not failures
