"""The request router's decisions, with the in-process store and a store that fails."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence

import pytest

from ext_proc.metrics import PrometheusCallbacks
from ext_proc.router import (
    STORE_BACKOFF_S,
    STORE_WAIT_CAP_S,
    PendingRoute,
    RequestRouter,
    RouterCallbacks,
    RouteResult,
    store_wait_s,
)
from prefix_router.core.config import RouterConfig
from prefix_router.core.decision import IN_FLIGHT_SLACK, Outcome
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.table import RoutingTable
from prefix_router.envoy.bootstrap import DEFAULT_EXT_PROC_TIMEOUT_MS
from prefix_router.state.routing import InProcessStore, Routed, StateUnavailable

CONFIG = RouterConfig()
TABLE = RoutingTable.build(Fleet.of([Instance("127.0.0.1", 8000 + i) for i in range(3)]), CONFIG)
SYSTEM = "You are the support assistant of a large company. " * 40
PATH = "/v1/chat/completions"


def body(question: str) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return json.dumps({"model": "m", "messages": messages}).encode()


class DownStore(InProcessStore):
    """A shared store whose server is down."""

    async def route(self, *args: object, **kwargs: object) -> Routed:
        raise StateUnavailable("connection refused")

    def route_at_once(self, *args: object, **kwargs: object) -> Routed | None:
        return None  # nothing held to decide on: every request would wait for the server


class ReleaseFailsStore(InProcessStore):
    """A store that gives the count back, then fails writing the index."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[tuple[str, tuple[int, ...]]] = []

    def release(
        self, instance_id: str, prefill_end: float = 0.0, blocks: Sequence[int] = ()
    ) -> None:
        super().release(instance_id, prefill_end)
        self.released.append((instance_id, tuple(blocks)))
        raise RuntimeError("index write failed")


class Errors(RouterCallbacks):
    def __init__(self) -> None:
        self.seen: list[BaseException] = []
        self.release_failures: list[BaseException] = []

    def on_error(self, error: BaseException) -> None:
        self.seen.append(error)

    def on_release_failed(self, error: BaseException) -> None:
        self.release_failures.append(error)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_shared_prefix_goes_home_and_a_hot_one_spreads_with_load() -> None:
    clock = Clock()
    router = RequestRouter(TABLE, InProcessStore(clock))
    first = await router.route(body("q0"), path=PATH, tenant="")
    router.finish(first)
    clock.now = 10.0  # its prefill is done: the next request finds the prefix cached
    again = await router.route(body("q1"), path=PATH, tenant="")
    assert first.decision.outcome is Outcome.PLACED and again.decision.outcome is Outcome.HOME
    assert again.decision.instance_id == first.decision.instance_id
    held = [again] + [await router.route(body(f"q{n}"), path=PATH, tenant="") for n in range(24)]
    assert {r.decision.outcome for r in held[1:]} >= {Outcome.SPILLED}
    # the in-flight bound spread them: none holds more than load_factor x the mean + the
    # slack (+ the one that crossed it)
    counts = Counter(r.decision.instance_id for r in held)
    assert (
        len(counts) >= 2
        and max(counts.values()) <= CONFIG.spill.load_factor * len(held) / 3 + IN_FLIGHT_SLACK + 1
    )
    # Envoy is steered by a header its ring maps to the chosen instance.
    for r in held:
        assert r.decision.header_value is not None
        picked = TABLE.ring.pick(r.decision.header_value)
        assert picked is not None and picked.id == r.decision.instance_id
    for r in held:
        router.finish(r)
    assert await router.store.in_flight() == {}


async def test_without_the_shared_store_it_decides_on_its_own_state() -> None:
    router = RequestRouter(TABLE, DownStore())
    results = [await router.route(body("same"), path=PATH, tenant="") for _ in range(12)]
    assert {r.decision.outcome for r in results} == {Outcome.RING_ONLY}
    assert len({r.decision.instance_id for r in results}) > 1  # still spread by load
    assert sum((await router.local.in_flight()).values()) == 12
    for r in results:
        router.finish(r)
    assert await router.local.in_flight() == {}


async def test_an_empty_fleet_routes_nothing() -> None:
    router = RequestRouter(RoutingTable.build(Fleet.of([]), CONFIG), InProcessStore())
    result = await router.route(body("x"), path=PATH, tenant="")
    assert result.decision.outcome is Outcome.NO_INSTANCES
    assert result.decision.header_value is None
    router.finish(result)


async def test_a_store_that_holds_its_state_decides_at_once() -> None:
    """``route_at_once`` decides without waiting when the store can; when it cannot, it
    hands back the keyed request, and ``finish_route`` decides it after the wait."""
    router = RequestRouter(TABLE, InProcessStore())
    result = router.route_at_once(body("q0"), path=PATH, tenant="")
    assert isinstance(result, RouteResult) and result.decision.outcome is Outcome.PLACED
    router.finish(result)
    waiting = RequestRouter(TABLE, DownStore())
    pending = waiting.route_at_once(body("q0"), path=PATH, tenant="")
    assert isinstance(pending, PendingRoute)
    finished = await waiting.finish_route(pending)  # the store is down: decided on its own
    assert finished.decision.outcome is Outcome.RING_ONLY


async def test_a_request_ends_with_its_blocks_and_a_failed_release_fails_nothing() -> None:
    """``finish`` hands the store the request's blocks (the instance used them until now);
    a store that fails after giving the count back is counted as a failed release (not
    as a second decision, an error), not raised into the stream's end."""
    store, errors = ReleaseFailsStore(), Errors()
    router = RequestRouter(TABLE, store, errors)
    result = await router.route(body("q0"), path=PATH, tenant="")
    router.finish(result)
    assert store.released == [(result.decision.instance_id, result.key.blocks)]
    assert len(result.key.blocks) > 1 and await store.in_flight() == {}
    assert [str(e) for e in errors.release_failures] == ["index write failed"]
    assert errors.seen == []


@pytest.mark.parametrize(
    ("redis_timeout_ms", "wait_s"),
    [(10, 0.1), (40, 0.4), (100, STORE_WAIT_CAP_S), (1000, STORE_WAIT_CAP_S)],
)
def test_a_request_waits_for_the_store_no_longer_than_envoy_waits_for_it(
    redis_timeout_ms: float, wait_s: float
) -> None:
    """Ten round trips, but never past Envoy's ext_proc message timeout (500 ms), after
    which the request would go on unrouted rather than on this replica's own state."""
    assert store_wait_s(redis_timeout_ms) == pytest.approx(wait_s)
    assert STORE_WAIT_CAP_S < DEFAULT_EXT_PROC_TIMEOUT_MS / 1000


class SlowlyDownStore(DownStore):
    """A shared store that fails only after a while (a timeout of its own)."""

    async def route(self, *args: object, **kwargs: object) -> Routed:
        await asyncio.sleep(0.2)
        raise StateUnavailable("timed out")


async def test_the_back_off_runs_from_the_failure_not_from_the_request() -> None:
    """A slow failure still leaves a whole back-off: the requests right after it decide
    on this replica's state instead of waiting on the store again."""
    router = RequestRouter(TABLE, SlowlyDownStore())
    started = time.monotonic()
    result = await router.route(body("slow"), path=PATH, tenant="")
    failed_at = started + 0.2  # at the earliest
    assert result.decision.outcome is Outcome.RING_ONLY
    assert router._store_down_until >= failed_at + STORE_BACKOFF_S


def test_an_instance_gone_from_the_table_keeps_its_series_only_while_it_has_requests() -> None:
    """ext_proc's in-flight gauge by instance: one that left the fleet is dropped once its
    last request ends, so a fleet that changes for weeks does not grow its series."""
    callbacks = PrometheusCallbacks()

    def series() -> dict[str, float]:
        return {
            s.labels["instance_id"]: s.value
            for m in callbacks.registry.collect()
            if m.name == "prefix_router_ext_proc_in_flight"
            for s in m.samples
        }

    callbacks.on_table(("a:1", "b:1"))
    callbacks.on_reserved("a:1")
    callbacks.on_reserved("b:1")
    callbacks.on_finished("b:1")
    callbacks.on_table(("c:1",))  # a and b left: b is idle, a still has a request
    assert series() == {"a:1": 1.0}
    callbacks.on_finished("a:1")
    assert series() == {}
    callbacks.on_reserved("c:1")
    callbacks.on_finished("c:1")
    assert series() == {"c:1": 0.0}  # in the table: kept at 0


class HangingStore(DownStore):
    """A shared store that never answers."""

    async def route(self, *args: object, **kwargs: object) -> Routed:
        await asyncio.Event().wait()
        raise AssertionError("never")


async def test_the_wait_follows_the_envoy_timeout_it_is_given() -> None:
    """With Envoy's message timeout set to 100 ms (--envoy-timeout-ms, as the bootstrap's
    --ext-proc-timeout-ms), a request stops waiting on a store that does not answer at
    80 ms and is decided on this replica's state, where the default cap waits 400 ms."""
    router = RequestRouter(TABLE, HangingStore(), envoy_timeout_ms=100)
    assert router.store_wait_cap_s == pytest.approx(0.08)
    result = await asyncio.wait_for(router.route(body("hang"), path=PATH, tenant=""), 5)
    assert result.decision.outcome is Outcome.RING_ONLY
    assert RequestRouter(TABLE, HangingStore()).store_wait_cap_s == STORE_WAIT_CAP_S
