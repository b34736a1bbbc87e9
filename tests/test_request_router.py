"""The request router's decisions, with the in-process store and a store that fails."""

from __future__ import annotations

import json

from ext_proc.router import RequestRouter
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.table import Outcome, RoutingTable
from prefix_router.state.loads import InMemoryLoadStore, LoadsUnavailable, Reservation

CONFIG = RouterConfig.model_validate({"concurrency_threshold": 2})
TABLE = RoutingTable.build(Fleet.of([Instance("127.0.0.1", 8000 + i) for i in range(3)]), CONFIG)
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hot"}]}).encode()
PATH = "/v1/chat/completions"


class DownStore(InMemoryLoadStore):
    """A shared store whose server is down."""

    async def reserve(self, *args: object, **kwargs: object) -> Reservation:
        raise LoadsUnavailable("connection refused")


async def test_hot_prefix_goes_home_then_spills_along_the_ring() -> None:
    router = RequestRouter(TABLE, InMemoryLoadStore())
    results = [await router.route(BODY, path=PATH, tenant="") for _ in range(5)]
    outcomes = [r.decision.outcome for r in results]
    assert outcomes == [
        Outcome.HOME,
        Outcome.HOME,
        Outcome.SPILLED,
        Outcome.SPILLED,
        Outcome.SPILLED,
    ]
    home = results[0].decision.instance_id
    spilled = results[2].decision
    assert spilled.home_id == home and spilled.instance_id != home
    # Envoy is steered by a header its ring maps to the chosen instance.
    assert spilled.header_value is not None
    picked = TABLE.ring.pick(spilled.header_value)
    assert picked is not None and picked.id == spilled.instance_id
    for r in results:
        router.finish(r)
    assert await router.store.in_flight() == {}


async def test_without_the_shared_store_it_spills_on_its_own_counts() -> None:
    router = RequestRouter(TABLE, DownStore())
    results = [await router.route(BODY, path=PATH, tenant="") for _ in range(3)]
    assert {r.decision.outcome for r in results} == {Outcome.RING_ONLY}
    assert len({r.decision.instance_id for r in results}) == 2  # home full at 2: spilled
    assert sum((await router.local.in_flight()).values()) == 3
    for r in results:
        router.finish(r)
    assert await router.local.in_flight() == {}


async def test_an_empty_fleet_routes_nothing() -> None:
    router = RequestRouter(RoutingTable.build(Fleet.of([]), CONFIG), InMemoryLoadStore())
    result = await router.route(BODY, path=PATH, tenant="")
    assert result.decision.outcome is Outcome.NO_INSTANCES
    assert result.decision.header_value is None
    router.finish(result)
