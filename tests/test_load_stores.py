"""One contract, two stores: in-process counts and Redis-shared counts (real Redis)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from prefix_router.core.config import PlacementPolicyName, SpillPolicyName
from prefix_router.core.placement import Placement, PlacementRule
from prefix_router.core.spill import SpillRule, choose
from prefix_router.state.loads import InMemoryLoadStore, LoadStore
from prefix_router.state.loads.redis_store import RedisLoadStore
from tests.conftest import REDIS_URL

BOUNDED = SpillRule(SpillPolicyName.BOUNDED_LOAD, threshold=2)
RELATIVE = SpillRule(SpillPolicyName.RELATIVE_LOAD, threshold=2, load_factor=1.5)
NONE = SpillRule(SpillPolicyName.NONE, threshold=2)
IDS = ["a", "b", "c"]


StoreFactory = Callable[[], Awaitable[LoadStore]]


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest, namespace: str) -> AsyncIterator[StoreFactory]:
    made: list[LoadStore] = []

    async def factory() -> LoadStore:
        store: LoadStore
        if request.param == "memory":
            store = InMemoryLoadStore()
        else:
            store = await RedisLoadStore.connect(REDIS_URL, namespace=namespace)
        made.append(store)
        return store

    yield factory
    for store in made:
        await store.close()


async def settle(store: LoadStore) -> None:
    """Let a store's background release flusher run."""
    for _ in range(50):
        await asyncio.sleep(0.01)
        if isinstance(store, RedisLoadStore) and not store._pending:
            await asyncio.sleep(0.01)
            return


async def test_bounded_load_fills_home_then_walks_the_ring(make_store: StoreFactory) -> None:
    store = await make_store()
    chosen = [(await store.reserve(IDS, BOUNDED, 3)).index for _ in range(7)]
    assert chosen == [0, 0, 1, 1, 2, 2, 0]
    assert await store.in_flight() == {"a": 3, "b": 2, "c": 2}


async def test_spill_disabled_always_goes_home(make_store: StoreFactory) -> None:
    store = await make_store()
    assert {(await store.reserve(IDS, NONE, 3)).index for _ in range(5)} == {0}


async def test_relative_load_matches_the_pure_rule(make_store: StoreFactory) -> None:
    store = await make_store()
    loads = {i: 0 for i in IDS}
    for _ in range(12):
        expected = choose(
            [loads[i] for i in IDS], RELATIVE, fleet_total=sum(loads.values()), fleet_size=3
        )
        got = await store.reserve(IDS, RELATIVE, 3)
        assert got.index == expected
        assert list(got.loads) == [loads[i] for i in IDS]
        loads[IDS[got.index]] += 1


async def test_concurrent_reserves_follow_the_pure_rule_in_order(make_store: StoreFactory) -> None:
    """Reserves queued together (one Redis round trip) each see the ones before them."""
    store = await make_store()
    for rule in (BOUNDED, RELATIVE):
        taken = await asyncio.gather(*(store.reserve(IDS, rule, 3) for _ in range(9)))
        loads = {i: 0 for i in IDS}
        for got in taken:
            expected = choose(
                [loads[i] for i in IDS], rule, fleet_total=sum(loads.values()), fleet_size=3
            )
            assert (got.index, list(got.loads)) == (expected, [loads[i] for i in IDS])
            loads[IDS[got.index]] += 1
        for got in taken:
            store.release(IDS[got.index])
        await settle(store)
        assert await store.in_flight() == {}


LEAST = PlacementRule(PlacementPolicyName.LEAST_LOADED, width=3, memory_s=600.0)
TAGS = [101, 202, 303]


async def test_a_new_prefix_starts_on_the_least_loaded_candidate_and_stays(
    make_store: StoreFactory,
) -> None:
    store = await make_store()
    for busy in ("a", "a", "c"):
        await store.reserve([busy], NONE, 3)
    placed = Placement(LEAST, slot=9, tags=TAGS)
    first = await store.reserve(IDS, BOUNDED, 3, "", placed)
    assert (first.start, first.index, list(first.loads)) == (1, 1, [2, 0, 1])  # b: idle
    await store.reserve(["b"], NONE, 3)
    # remembered (b) though b is now as busy as a; spill (threshold 2) walks from b: a, c
    again = await store.reserve(IDS, BOUNDED, 3, "", placed)
    assert (again.start, again.index, list(again.loads)) == (1, 2, [2, 2, 1])
    ring_only = await store.reserve(IDS, NONE, 3, "", Placement(PlacementRule(), 9, TAGS))
    assert (ring_only.start, ring_only.index) == (0, 0)


async def test_a_remembered_home_holds_until_the_ring_gives_the_key_away(
    make_store: StoreFactory,
) -> None:
    store = await make_store()
    await store.reserve(["a", "b", "c"], NONE, 3)  # a busy
    placed = Placement(LEAST, slot=5, tags=TAGS)
    assert (await store.reserve(IDS, NONE, 3, "", placed)).start == 1  # b
    inserted = Placement(LEAST, slot=5, tags=[101, 404, 202, 303])  # d joined, after a
    assert (await store.reserve(["a", "d", "b", "c"], NONE, 4, "", inserted)).start == 2  # b
    pick_left = Placement(LEAST, slot=5, tags=[303, 202])  # a, its ring pick, left
    assert (await store.reserve(["c", "b"], NONE, 2, "", pick_left)).start == 1  # b holds
    assert (await store.reserve(IDS, NONE, 3, "", placed)).start == 0  # a came back: its key
    shifted = Placement(LEAST, slot=5, tags=[303, 101, 202])  # c took a's ring position
    await store.reserve(["c"], NONE, 3)
    await store.reserve(["c"], NONE, 3)  # c the busiest: the ring's pick all the same
    assert (await store.reserve(["c", "a", "b"], NONE, 3, "", shifted)).start == 0
    assert (await store.reserve(["c", "a", "b"], NONE, 3, "", shifted)).start == 0
    new_home = Placement(LEAST, slot=5, tags=[404, *TAGS])  # d took the key's ring position
    assert (await store.reserve(["d", *IDS], NONE, 4, "", new_home)).start == 0


async def test_stores_agree_on_a_random_sequence(namespace: str) -> None:
    """The Lua and the pure rules: the same decisions for the same requests."""
    rng = random.Random(7)
    memory = InMemoryLoadStore()
    shared = await RedisLoadStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    ids = ["a", "b", "c", "d", "e"]
    tags = {i: 1000 + n for n, i in enumerate(ids)}
    try:
        held: list[str] = []
        for step in range(300):
            if held and rng.random() < 0.45:
                gone = held.pop(rng.randrange(len(held)))
                memory.release(gone)
                shared.release(gone)
                continue
            candidates = rng.sample(ids, rng.randint(1, len(ids)))
            rule = rng.choice([BOUNDED, RELATIVE, NONE])
            placement = rng.choice(
                [None, Placement(LEAST, rng.randrange(6), [tags[c] for c in candidates])]
            )
            want = await memory.reserve(candidates, rule, len(ids), "", placement)
            got = await shared.reserve(candidates, rule, len(ids), "", placement)
            assert got == want, f"step {step}"
            held.append(candidates[got.index])
    finally:
        await shared.close()


async def test_releases_bring_every_count_back_to_zero(make_store: StoreFactory) -> None:
    store = await make_store()
    taken = [IDS[(await store.reserve(IDS, BOUNDED, 3)).index] for _ in range(6)]
    for instance_id in taken:
        store.release(instance_id)
    store.release("a")  # one release too many changes nothing
    await settle(store)
    assert await store.in_flight() == {}


async def test_a_share_in_doubt_is_rewritten_before_the_next_batch(namespace: str) -> None:
    """A round trip that failed may still have been applied. The flusher rewrites the
    share from the exact local counts before it sends anything else, so a release
    queued meanwhile cannot be undone by a rewrite overtaking it (the heartbeat used
    to rewrite on its own connection, and a lost race left a count stuck at 1)."""
    store = await RedisLoadStore.connect(REDIS_URL, namespace=namespace)
    store._tasks[1].cancel()  # no heartbeat: only the flusher may repair the share
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert (await store.reserve(IDS, BOUNDED, 3)).index == 0
        # A reserve Redis applied although its reply was lost, which marks the share in doubt.
        for key in (store.fleet_key, store.share_key):
            await client.hincrby(key, "a", 1)
        store._in_doubt = True
        assert await store.in_flight() == {"a": 2}
        store.release("a")
        for _ in range(200):  # up to 2 s: the flusher's next round trip
            if await store.in_flight() == {}:
                break
            await asyncio.sleep(0.01)
        assert await store.in_flight() == {}
        assert await client.hgetall(store.share_key) == {}
        assert (await store.reserve(IDS, BOUNDED, 3)).loads == (0, 0, 0)
    finally:
        await store.close()
        await client.aclose()


async def test_two_replicas_share_counts(namespace: str) -> None:
    one = await RedisLoadStore.connect(REDIS_URL, namespace=namespace)
    two = await RedisLoadStore.connect(REDIS_URL, namespace=namespace)
    try:
        results = await asyncio.gather(*(s.reserve(IDS, BOUNDED, 3) for s in [one, two] * 3))
        assert sorted(r.index for r in results) == [0, 0, 1, 1, 2, 2]
        assert await one.in_flight() == {"a": 2, "b": 2, "c": 2}
    finally:
        await one.close()
        await two.close()
    client = aioredis.Redis.from_url(REDIS_URL)
    assert await client.hgetall(f"{namespace}inflight") == {}
    await client.aclose()


async def test_a_dead_replicas_counts_disappear(namespace: str) -> None:
    dead = await RedisLoadStore.connect(REDIS_URL, namespace=namespace)
    for _ in range(3):
        await dead.reserve(IDS, BOUNDED, 3)
    dead.release("a")  # its share now holds a field that went back to 0
    await settle(dead)
    await dead.stop_tasks()  # dies: no more heartbeats, no goodbye
    await dead.redis.delete(dead.alive_key)  # as if its heartbeat TTL ran out
    survivor = await RedisLoadStore.connect(REDIS_URL, namespace=namespace)
    try:
        await survivor.beat()
        assert await survivor.in_flight() == {}
    finally:
        await survivor.close()
        await dead.redis.aclose()


async def test_redis_down_raises_loads_unavailable_quickly() -> None:
    store = await RedisLoadStore.connect("redis://127.0.0.1:1/0", namespace="nowhere:")
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(Exception) as caught:
            async with asyncio.timeout(0.5):
                await store.reserve(IDS, BOUNDED, 3)
        assert loop.time() - started < 0.5
        assert caught.type.__name__ in ("LoadsUnavailable", "TimeoutError")
    finally:
        await store.close()


async def test_redis_counts_decisions_and_keeps_recent_spills(namespace: str) -> None:
    store = await RedisLoadStore.connect(REDIS_URL, namespace=namespace)
    try:
        for i in range(4):
            await store.reserve(IDS, BOUNDED, 3, request_id=f"req-{i}")
        client = aioredis.Redis.from_url(REDIS_URL)
        assert await client.hgetall(f"{namespace}decisions") == {b"home": b"2", b"spilled": b"2"}
        spills = [json.loads(s) for s in await client.lrange(f"{namespace}spills", 0, -1)]
        await client.aclose()
        assert [(s["request_id"], s["home"], s["to"]) for s in spills] == [
            ("req-3", "a", "b"),
            ("req-2", "a", "b"),
        ]
        assert spills[0]["home_in_flight"] == 2 and spills[0]["time"] > 1.7e9
    finally:
        await store.close()
