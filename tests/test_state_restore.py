"""Redis restarted empty: readers keep the last state, the control plane writes it back;
and the supervisor's report, which ``up`` writes next to that state. Real Redis."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
import redis

from control_plane.restore import StateKeeper
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.state.store import StateStore, watch_state
from prefix_router.state.supervision import read_report, supervision_key, write_report
from tests.conftest import REDIS_URL
from tests.support.state_records import A, B, add
from tests.support.supervision import REPORT


async def lose_state(store: StateStore) -> None:
    """What a Redis restarted without persistence holds of the namespace: nothing."""
    assert await store.delete_namespace() > 0


async def test_restore_writes_back_only_what_is_absent_with_its_versions(
    store: StateStore,
) -> None:
    await store.update_fleet(add(A))
    await store.update_fleet(add(B))
    await store.update_config(lambda c: c.patched({"prefix_length": 77}))
    before = await store.read()
    assert before.versions == (2, 1)
    await lose_state(store)
    assert (await store.read()).versions == (0, 0)

    assert await store.restore(before.fleet, before.config)
    after = await store.read()
    assert after == before
    [entry] = await store.audit_log()
    assert (entry["action"], entry["fleet_version"], entry["config_version"]) == (
        "restore-state",
        2,
        1,
    )
    # present now: a second restore (another replica, later) writes nothing
    assert not await store.restore(before.fleet, before.config)
    # nor over a newer document written meanwhile
    await store.redis.delete(store.keys.config)
    await store.update_config(lambda c: c.patched({"prefix_length": 5}))
    assert not await store.restore(None, before.config)
    assert (await store.read()).config.config.prefix_length == 5


async def test_a_change_to_a_lost_document_starts_from_the_last_one_seen(
    store: StateStore,
) -> None:
    """An admin call in the moment between the loss and the keeper's restore changes the
    fleet and config the store last saw, versions going on: it wipes nothing."""
    await store.update_fleet(add(A))
    await store.update_config(lambda c: c.patched({"prefix_length": 77}))
    await store.read()
    await lose_state(store)
    before, after = await store.update_fleet(add(B))
    assert before.fleet.version == 1
    assert after.fleet.version == 2
    assert [i.id for i in after.fleet.instances] == [A.id, B.id]
    _, config = await store.update_config(lambda c: c.patched({"prefix_mode": "bytes"}))
    assert (config.version, config.config.prefix_length) == (2, 77)
    assert (await store.read()).versions == (2, 2)
    assert not await StateKeeper(store).check()  # nothing left to restore


async def test_the_keeper_restores_what_redis_lost(store: StateStore) -> None:
    keeper = StateKeeper(store)
    assert not await keeper.check()  # nothing read yet: nothing to restore
    await store.seed(Fleet.of([A, B]), RouterConfig(prefix_length=64))
    await store.update_fleet(add(Instance("127.0.0.1", 9003)))
    assert not await keeper.check()
    known = await store.read()
    await lose_state(store)
    assert await keeper.check()
    assert await store.read() == known
    assert keeper.restored == 1
    assert not await keeper.check()


async def test_the_keeper_restores_a_write_made_since_its_last_read(store: StateStore) -> None:
    """The admin API changes the fleet through the keeper's store in the second before
    Redis restarts empty: that change is what comes back, not the keeper's last read,
    which would take the fleet's version back under what Envoy was sent."""
    keeper = StateKeeper(store)
    await store.seed(Fleet.of([A]), RouterConfig())
    assert not await keeper.check()
    await store.update_fleet(add(B))
    known = await store.read()
    assert known.versions == (2, 1)
    await lose_state(store)
    assert await keeper.check()
    assert await store.read() == known


async def test_watchers_keep_the_last_state_while_redis_has_lost_it(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prefix_router.state.store")
    await store.seed(Fleet.of([A]), RouterConfig())
    seen: list[tuple[int, int]] = []
    stop = asyncio.Event()
    task = asyncio.create_task(
        watch_state(
            REDIS_URL,
            store.keys.namespace,
            lambda f, c, v: seen.append((f.version, v)),
            interval=0.05,
            stop=stop,
        )
    )

    async def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 20
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert condition(), what

    try:
        await wait_for(lambda: seen == [(1, 1)], "the first state")
        known = await store.read()
        await lose_state(store)
        await wait_for(lambda: "shared state gone from Redis" in caplog.text, "the loss seen")
        assert seen == [(1, 1)]  # not handed an empty fleet
        await store.restore(known.fleet, known.config)
        await wait_for(lambda: "shared state back in Redis" in caplog.text, "the state back")
        await store.update_fleet(add(B))
        await wait_for(lambda: len(seen) == 2, "the next change")
        assert seen == [(1, 1), (2, 1)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_the_report_goes_through_redis_and_expires(store: StateStore) -> None:
    ns = store.keys.namespace
    assert await read_report(store.redis, ns) is None  # no up: no report
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        write_report(client, ns, REPORT, ttl_s=15)
        assert await read_report(store.redis, ns) == REPORT
        assert 0 < client.pttl(supervision_key(ns)) <= 15_000
        client.set(supervision_key(ns), b'{"supervisor_pid": "nope"}')
        assert await read_report(store.redis, ns) is None  # unreadable: as if absent
    finally:
        client.close()
