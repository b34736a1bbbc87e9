"""The shared state in real Redis: atomic versioned writes, audit, namespaces, watching."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from prefix_router.core.config import RouterConfig
from prefix_router.core.errors import FleetError
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.state.store import FleetRecord, StateStore, watch_state
from tests.conftest import REDIS_URL
from tests.support.state_records import A, B, add
from tests.support.wait import async_wait_until


async def test_empty_namespace_reads_version_zero_defaults(store: StateStore) -> None:
    state = await store.read()
    assert state.versions == (0, 0)
    assert state.fleet.fleet.instances == ()
    assert state.config.config == RouterConfig()


async def test_seed_writes_only_an_empty_namespace(store: StateStore) -> None:
    await store.seed(Fleet.of([A]), RouterConfig(prefix_length=64))
    state = await store.seed(Fleet.of([B]), RouterConfig(prefix_length=8))
    assert [i.id for i in state.fleet.fleet.instances] == [A.id]
    assert state.config.config.prefix_length == 64
    assert state.versions == (1, 1)


async def test_each_change_bumps_the_version_and_writes_its_audit_entry(
    store: StateStore,
) -> None:
    before, after = await store.update_fleet(
        add(A), audit=lambda b, a: {"action": "add", "after": a.fleet.version}
    )
    assert (before.fleet.version, after.fleet.version) == (0, 1)
    _, after = await store.update_fleet(add(B))
    assert after.fleet.version == 2
    assert [i.id for i in (await store.read()).fleet.fleet.instances] == [A.id, B.id]
    [entry] = await store.audit_log()
    assert entry["action"] == "add" and entry["after"] == 1 and entry["time"] > 0


async def test_a_failing_or_empty_change_writes_nothing(store: StateStore) -> None:
    await store.update_fleet(add(A))

    def boom(record: FleetRecord) -> FleetRecord:
        raise FleetError("no")

    with pytest.raises(FleetError):
        await store.update_fleet(boom, audit=lambda b, a: {"action": "boom"})
    before, after = await store.update_fleet(lambda r: r, audit=lambda b, a: {"action": "noop"})
    assert after is before
    assert (await store.read()).fleet.fleet.version == 1
    assert await store.audit_log() == []


async def test_concurrent_writers_lose_no_change(store: StateStore) -> None:
    others = [StateStore.from_url(REDIS_URL, store.keys.namespace) for _ in range(4)]
    try:
        await asyncio.gather(
            *(
                s.update_fleet(add(Instance("127.0.0.1", 10000 + i)))
                for i, s in enumerate(others * 3)
            )
        )
    finally:
        for s in others:
            await s.close()
    record = (await store.read()).fleet
    assert len(record.fleet.instances) == 12
    assert record.fleet.version == 12


async def test_namespaces_do_not_see_each_other(store: StateStore) -> None:
    await store.update_fleet(add(A))
    other = StateStore(store.redis, "test-other-" + store.keys.namespace)
    assert (await other.read()).versions == (0, 0)


async def test_watch_state_sees_a_change_by_pub_sub(store: StateStore) -> None:
    seen: list[tuple[int, int]] = []
    stop = asyncio.Event()

    def on_change(fleet: Fleet, config: RouterConfig, version: int) -> None:
        seen.append((fleet.version, version))

    # A re-read interval far past the wait's deadline: only pub/sub can deliver the change.
    task = asyncio.create_task(
        watch_state(REDIS_URL, store.keys.namespace, on_change, interval=3600.0, stop=stop)
    )
    try:
        await async_wait_until(lambda: seen, 30, "the first state is read")
        assert seen == [(0, 0)]
        await store.update_config(lambda c: c.patched({"prefix_length": 99}))
        await async_wait_until(lambda: len(seen) == 2, 30, "the change arrives")
        assert seen == [(0, 0), (0, 1)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_watch_state_heals_a_missed_message_by_re_reading(store: StateStore) -> None:
    seen: list[int] = []
    stop = asyncio.Event()
    task = asyncio.create_task(
        watch_state(
            REDIS_URL,
            store.keys.namespace,
            lambda f, c, v: seen.append(f.version),
            interval=0.3,
            stop=stop,
        )
    )
    try:
        await async_wait_until(lambda: seen, 30, "the first state is read")
        # Write behind the watcher's back: no publish.
        await store.redis.set(store.keys.fleet, FleetRecord(Fleet.of([A], version=7)).to_json())
        await async_wait_until(lambda: seen[-1] == 7, 30, "the re-read finds it")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_delete_namespace_removes_every_key(store: StateStore) -> None:
    await store.update_fleet(add(A), audit=lambda b, a: {"action": "add"})
    await store.redis.hset(store.keys.inflight, A.id, 3)
    assert await store.in_flight() == {A.id: 3}
    assert await store.delete_namespace() == 3
    assert await store.redis.exists(store.keys.fleet, store.keys.audit, store.keys.inflight) == 0


async def test_watch_state_survives_a_failing_callback(store: StateStore) -> None:
    calls: list[int] = []
    stop = asyncio.Event()

    def flaky(fleet: Fleet, config: RouterConfig, version: int) -> None:
        calls.append(fleet.version)
        if len(calls) == 1:
            raise RuntimeError("boom")

    task = asyncio.create_task(
        watch_state(REDIS_URL, store.keys.namespace, flaky, interval=0.1, stop=stop)
    )
    try:
        await async_wait_until(lambda: len(calls) >= 2, 30, "the callback is retried")
        assert calls[:2] == [0, 0]  # retried after the failure
        await store.update_fleet(add(A))
        await async_wait_until(lambda: calls[-1] == 1, 30, "the change arrives")
        assert calls[-1] == 1 and not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_an_audit_entry_is_logged_once_for_the_change_that_landed(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A change that loses a race is made again, its audit entry too: only the one that
    landed is logged, with the version it landed as."""
    caplog.set_level(logging.INFO, logger="prefix_router.audit")
    await store.update_fleet(add(A))
    rival = redis.Redis.from_url(REDIS_URL)
    raced = []

    def audit(before: FleetRecord, after: FleetRecord) -> dict[str, object]:
        if not raced:  # another writer changes the fleet between the read and the write
            raced.append(True)
            rival.set(store.keys.fleet, FleetRecord(Fleet.of([A], version=5)).to_json())
        return {"action": "add", "fleet_version": after.fleet.version}

    try:
        await store.update_fleet(add(B), audit=audit)
    finally:
        rival.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "prefix_router.audit"]
    assert len(logged) == 1 and "'fleet_version': 6" in logged[0], logged
    [entry] = await store.audit_log()
    assert entry["fleet_version"] == 6
