"""One decision function, two stores: in process, and shared through a real Redis."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_exceptions

from prefix_router.core.config import RouterConfig
from prefix_router.core.decision import Outcome
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.index import SLOT_BYTES
from prefix_router.core.key import PrefixKey, extract_key
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import InstanceModel, model_of_text, model_text
from prefix_router.state.clock import parse_clock_scale, scaled_clock
from prefix_router.state.routing import (
    InProcessStore,
    Routed,
    RoutingStore,
    StateUnavailable,
    redis_lua,
    redis_store,
)
from prefix_router.state.routing.redis_store import RedisStore
from tests.conftest import REDIS_URL

FLEET = Fleet.of([Instance("10.0.0.1", 8000 + i) for i in range(4)])
CONFIG = RouterConfig().patched(
    {
        "prefix_mode": "bytes",
        "index": {"slots_log2": 12},
        # prefill so fast that no queue builds up between two requests of a test: decisions
        # then depend on the index and the in-flight counts only, the same in both stores
        "instance_defaults": {"prefill_tokens_per_s": 1e9},
        "concurrency_threshold": 1000,
    }
)
TABLE = RoutingTable.build(FLEET, CONFIG)

StoreFactory = Callable[[], Awaitable[RoutingStore]]


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest, namespace: str) -> AsyncIterator[StoreFactory]:
    made: list[RoutingStore] = []

    async def factory() -> RoutingStore:
        store: RoutingStore
        if request.param == "memory":
            store = InProcessStore()
        else:
            store = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
        made.append(store)
        return store

    yield factory
    for store in made:
        await store.close()


def key(body: bytes) -> PrefixKey:
    return extract_key(body, settings=TABLE.key_settings, path="/x")


async def route(store: RoutingStore, body: bytes, request_id: str = "") -> Routed:
    return await store.route(key(body), TABLE, request_id)


async def settled(store: RoutingStore, expected: dict[str, int]) -> dict[str, int]:
    """The store's in-flight counts once its background writes have landed (up to 5 s)."""
    counts = await store.in_flight()
    for _ in range(500):
        if counts == expected:
            break
        await asyncio.sleep(0.01)
        counts = await store.in_flight()
    return counts


async def recovered(store: RedisStore) -> None:
    """Wait out the store's recovery from a failed round trip (it refuses to queue requests
    meanwhile: they route on the replica's own state)."""
    for _ in range(500):
        if not store._recovering:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the store did not recover within 5 s")


def doc(name: str, size: int = 3000) -> bytes:
    return (name.encode() * size)[:size]


async def test_a_prefix_is_placed_once_and_found_by_its_next_requests(
    make_store: StoreFactory,
) -> None:
    store = await make_store()
    first = await route(store, doc("report") + b"question 1")
    assert first.decision.outcome is Outcome.PLACED
    store.release(first.instance_id)
    for n in range(2, 6):
        again = await route(store, doc("report") + f"question {n}".encode())
        assert (again.decision.outcome, again.instance_id) == (Outcome.HOME, first.instance_id)
        # the shared 3000 B: the block to 2048, and half the next one (to 3010)
        assert again.decision.cached_tokens == (2048 + (3010 - 2048) // 2) // 4
        store.release(again.instance_id)
    assert await settled(store, {}) == {}


async def test_requests_of_one_batch_each_see_the_ones_before_them(namespace: str) -> None:
    """Eight requests for one prefix at once (one Redis round trip) go where they would go
    one after another: the in-flight bound spreads them over the prefix's holders."""
    bodies = [doc("hot") + bytes([n]) for n in range(8)]
    one_by_one = InProcessStore(clock=lambda: 1.0)  # one instant, as one round trip reads
    expected_ids = [(await route(one_by_one, body)).instance_id for body in bodies]
    assert len(set(expected_ids)) > 1
    store = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    try:
        routed = await asyncio.gather(*(route(store, body) for body in bodies))
        assert [r.instance_id for r in routed] == expected_ids
        expected = {i: expected_ids.count(i) for i in set(expected_ids)}
        assert await settled(store, expected) == expected
        for r in routed:
            store.release(r.instance_id)
        assert await settled(store, {}) == {}
    finally:
        await store.close()


async def test_stores_decide_alike_on_a_random_sequence(namespace: str) -> None:
    """The Redis store's reads and atomic writes give the decision function the same state
    the in-process store does: the same choices, step by step."""
    rng = random.Random(7)
    memory = InProcessStore()
    shared = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    heads = [doc(f"system prompt {n}", rng.randint(600, 6000)) for n in range(6)]
    conversations: list[bytes] = []
    try:
        held: list[str] = []
        for step in range(250):
            if held and rng.random() < 0.4:
                gone = held.pop(rng.randrange(len(held)))
                memory.release(gone)
                shared.release(gone)
                continue
            if conversations and rng.random() < 0.5:
                n = rng.randrange(len(conversations))
                conversations[n] += doc(f"turn {step}", rng.randint(100, 900))
                body = conversations[n]
            else:
                body = rng.choice(heads) + doc(f"user {step}", rng.randint(10, 400))
                conversations.append(body)
            want = await route(memory, body)
            got = await route(shared, body)
            assert (got.instance_id, got.decision.outcome, got.decision.cached_tokens) == (
                want.instance_id,
                want.decision.outcome,
                want.decision.cached_tokens,
            ), f"step {step}"
            held.append(got.instance_id)
    finally:
        await shared.close()


async def test_replicas_share_the_index_and_the_counts(namespace: str) -> None:
    one = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    two = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    try:
        placed = await route(one, doc("manual") + b"first")
        # one's writes (count and index) ride on its next round trip, together
        assert await settled(two, {placed.instance_id: 1}) == {placed.instance_id: 1}
        one.release(placed.instance_id)
        assert await settled(two, {}) == {}
        found = await route(two, doc("manual") + b"second")
        assert (found.decision.outcome, found.instance_id) == (Outcome.HOME, placed.instance_id)
        assert await settled(one, {placed.instance_id: 1}) == {placed.instance_id: 1}
        two.release(found.instance_id)
        assert await settled(one, {}) == {}
    finally:
        await one.close()
        await two.close()


async def fresh(store: RedisStore, body: bytes, table: RoutingTable = TABLE) -> Routed:
    """Route ``body`` on ``store`` after its copy has caught up with everything written so
    far: a request of its own, whose writes go out with a round trip that reads the log."""
    warm = await store.route(key(doc("warm-up") + str(time.monotonic()).encode()), table)
    store.release(warm.instance_id)
    seq = store._copy.seq if store._copy else -1
    for _ in range(500):  # the round trip after the writes, within WRITE_DELAY_S
        await asyncio.sleep(0.002)
        if store._copy is not None and store._copy.seq > seq and not store._next:
            break
    return await store.route(key(body), table)


async def test_a_replica_decides_at_once_on_its_copy_and_sees_the_others(
    namespace: str,
) -> None:
    """With a fresh copy of the routing state a replica routes without a round trip, and
    the index log brings it what another replica placed meanwhile."""
    one = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    two = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    try:
        await fresh(two, doc("two's own"))  # two has a copy from here on
        placed = await route(one, doc("handbook") + b"first")
        assert placed.decision.outcome is Outcome.PLACED
        await settled(one, {placed.instance_id: 1, **await one.in_flight()})
        before = two.decided_at_once
        found = await fresh(two, doc("handbook") + b"second")
        assert two.decided_at_once > before  # decided on the copy, no round trip waited
        assert (found.decision.outcome, found.instance_id) == (Outcome.HOME, placed.instance_id)
    finally:
        await one.close()
        await two.close()


async def test_a_replica_behind_the_log_loads_the_index_again(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_lua, "LOG_KEEP", 2)
    one = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    two = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    try:
        await fresh(two, doc("two's own"))
        loaded = two._copy
        for n in range(5):  # five batches of index writes: more than the log keeps
            seq = one._copy.seq if one._copy else -1
            placed = await route(one, doc(f"book {n}") + b"first")
            one.release(placed.instance_id)
            for _ in range(500):  # until its own round trip has logged the writes
                if one._copy is not None and one._copy.seq > seq:
                    break
                await asyncio.sleep(0.002)
        found = await fresh(two, doc("book 4") + b"second")
        assert two._copy is not loaded  # loaded again
        assert (found.decision.outcome, found.instance_id) == (Outcome.HOME, placed.instance_id)
    finally:
        await one.close()
        await two.close()


async def test_an_idle_replica_keeps_its_copy_current(namespace: str) -> None:
    """A replica with no traffic of its own still reads the index log (every
    ``REFRESH_S``), so it does not fall behind what the log keeps."""
    one = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    two = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    try:
        routed = await fresh(two, doc("two's own"))
        two.release(routed.instance_id)
        for _ in range(500):  # two's last writes gone: from here on it has no traffic
            await asyncio.sleep(0.002)
            if not two._next and two._write_timer is None:
                break
        await asyncio.sleep(0.01)
        assert two._copy is not None
        seq = two._copy.seq
        placed = await route(one, doc("atlas") + b"first")
        one.release(placed.instance_id)
        for _ in range(200):
            if two._copy is not None and two._copy.seq > seq:
                break
            await asyncio.sleep(0.01)
        assert two._copy is not None and two._copy.seq > seq
    finally:
        await one.close()
        await two.close()


async def test_with_no_staleness_every_decision_waits_for_a_round_trip(namespace: str) -> None:
    table = RoutingTable.build(FLEET, CONFIG.patched({"redis_max_staleness_ms": 0}))
    store = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    try:
        for n in range(5):
            routed = await store.route(key(doc("report") + bytes([n])), table)
            store.release(routed.instance_id)
            await asyncio.sleep(0.001)
        assert (store.decided_at_once, store.decided_after_round_trip) == (0, 5)
        assert store._copy is None
    finally:
        await store.close()


async def test_a_caller_giving_up_as_its_reservation_is_made_leaks_no_count(
    namespace: str,
) -> None:
    """The router's backstop may cancel a wait in the very turn the flusher resolves it;
    the reservation made for it is given back (the count would stay up for good)."""
    table = RoutingTable.build(FLEET, CONFIG.patched({"redis_max_staleness_ms": 0}))
    store = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    try:
        waiter = asyncio.create_task(store.route(key(doc("given up")), table))
        await asyncio.sleep(0)
        [waiting] = store._waiting
        deadline = time.monotonic() + 10
        while not waiting.future.done():  # resolved; the waiter has not run since
            assert time.monotonic() < deadline, "the flusher never resolved the wait"
            await asyncio.sleep(0)
        reserved = waiting.future.result().instance_id
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        other = await store.route(key(doc("after")), table)  # a round trip after the writes
        store.release(other.instance_id)
        assert await settled(store, {}) == {}, f"{reserved} kept the given-up request"
    finally:
        await store.close()


async def test_a_share_in_doubt_is_rewritten_before_the_next_batch(namespace: str) -> None:
    """A round trip that failed may still have been applied. The flusher rewrites the
    share from the exact local counts before it sends anything else, so a release
    queued meanwhile cannot be undone by a rewrite overtaking it."""
    store = await RedisStore.connect(REDIS_URL, namespace=namespace)
    store._tasks[1].cancel()  # no heartbeat: only the flusher may repair the share
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        first = await route(store, doc("a"))
        counted = {first.instance_id: 1}
        assert await settled(store, counted) == counted  # the reservation landed
        # A request Redis counted although the reply was lost, which marks the share in doubt.
        for k in (store.fleet_key, store.share_key):
            await client.hincrby(k, first.instance_id, 1)
        store._in_doubt = True
        store.release(first.instance_id)
        assert await settled(store, {}) == {}
        assert await client.hgetall(store.share_key) == {}
    finally:
        await store.close()
        await client.aclose()


async def test_a_write_of_the_outage_that_lands_late_is_undone(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen Redis applies the writes waiting in its sockets when it thaws, in no set
    order: one may land after the first rewrite. The share is rewritten once more
    ``SETTLE_S`` later, so no count leaks for good."""
    monkeypatch.setattr(redis_store, "SETTLE_S", 0.0)
    store = await RedisStore.connect(REDIS_URL, namespace=namespace)
    store._tasks[1].cancel()  # heartbeats only when the test calls beat()
    client = aioredis.Redis.from_url(REDIS_URL)
    real_sync = store._sync
    try:

        async def lost(**_: object) -> bytes:
            store._sync = real_sync
            raise ConnectionError("the round trip is lost")

        store._sync = lost  # type: ignore[method-assign]
        with pytest.raises(StateUnavailable):
            await route(store, doc("a"))
        await recovered(store)
        kept = await route(store, doc("b"))  # rewrites the share first
        want = {kept.instance_id: 1}
        assert await settled(store, want) == want
        for k in (store.fleet_key, store.share_key):  # a reserve of the outage, applied now
            await client.hincrby(k, "10.0.0.9:8000", 1)
        await store.beat()
        assert await settled(store, want) == want
        store.release(kept.instance_id)
        assert await settled(store, {}) == {}
        assert await client.hgetall(store.share_key) == {}
    finally:
        await store.close()
        await client.aclose()


async def test_waiting_an_instance_reports_counts_against_the_threshold(
    make_store: StoreFactory, namespace: str
) -> None:
    """vLLM's own ``num_requests_waiting`` (published by the control plane, stamped with
    the time it was read) counts when it says more than the router's own count: requests
    that reached the instance by another path make it overloaded too."""
    table = RoutingTable.build(FLEET, CONFIG.patched({"concurrency_threshold": 4}))
    store = await make_store()
    home = await store.route(key(doc("report") + b"q0"), table)
    store.release(home.instance_id)

    async def reports(waiting: int, age_s: float) -> None:
        model = InstanceModel(1e9, table.default_model.kv_cache_tokens, waiting)
        if isinstance(store, InProcessStore):
            store.learn(home.instance_id, model_of_text(model_text(model, -age_s), 0.0))
            return
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            text = model_text(model, time.time() - age_s)
            await client.hset(f"{namespace}models", home.instance_id, text)
        finally:
            await client.aclose()
        assert isinstance(store, RedisStore)
        await store.beat()

    for waiting, age_s, stays in [(3, 0.0, True), (4, 0.0, False), (40, 60.0, True)]:
        await reports(waiting, age_s)
        routed = await store.route(key(doc("report") + b"q1"), table)
        store.release(routed.instance_id)
        assert (routed.instance_id == home.instance_id) is stays, (waiting, age_s)
        assert routed.decision.outcome is (Outcome.HOME if stays else Outcome.SPILLED)


async def test_redis_keeps_only_the_prefill_ends_still_ahead(namespace: str) -> None:
    """Each instance's queue in Redis holds the prefill ends still ahead, as
    :func:`prefix_router.core.work.admit` keeps them: ends already passed are dropped by
    the next request queued there, not kept up to ConcurrencyThreshold and parsed again
    by every round trip."""
    fast = RoutingTable.build(Fleet.of([FLEET.instances[0]]), CONFIG)
    store = await RedisStore.connect(REDIS_URL, namespace=namespace, clock_scale=1000.0)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for n in range(20):  # each prefill ends within a millisecond of wall time
            routed = await store.route(key(doc(f"q{n}")), fast)
            store.release(routed.instance_id)
            await asyncio.sleep(0.005)
        await settled(store, {})
        queue = await client.hget(f"{namespace}work", f"{routed.instance_id}:queue")
        assert queue is not None and len(queue) == 8, queue  # one float64: the last end
    finally:
        await store.close()
        await client.aclose()


class SlowRedis:
    """A TCP proxy to the test Redis that holds each reply ``delay`` seconds: a Redis far
    away."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        url = urlsplit(REDIS_URL)
        self.upstream = (url.hostname or "127.0.0.1", url.port or 6379)
        auth = url.netloc.rpartition("@")[0]
        port = self.server.sockets[0].getsockname()[1]
        return url._replace(
            netloc=f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}"
        ).geturl()

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, slow: bool) -> None:
            try:
                while data := await r.read(65536):
                    if slow:
                        await asyncio.sleep(self.delay)
                    w.write(data)
                    await w.drain()
            except OSError:
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


async def test_after_a_slow_spell_a_far_redis_is_used_again(namespace: str) -> None:
    """A Redis whose round trip takes two thirds of ``redis_timeout_ms`` serves again
    after one timed out: the share's rewrite and the next sync are bounded each on its
    own, and the new connection's handshake is not counted against them."""
    table = RoutingTable.build(FLEET, CONFIG.patched({"redis_max_staleness_ms": 0}))
    proxy = SlowRedis(0.2)
    async with proxy as url:
        store = await RedisStore.connect(url, namespace=namespace, timeout_s=0.3)
        try:
            store.release((await store.route(key(doc("near")), table)).instance_id)
            proxy.delay = 0.5
            with pytest.raises(StateUnavailable):
                await store.route(key(doc("slow")), table)
            proxy.delay = 0.2
            deadline = time.monotonic() + 8
            while True:
                try:
                    store.release((await store.route(key(doc("again")), table)).instance_id)
                    break
                except StateUnavailable:
                    assert time.monotonic() < deadline, "the store never used Redis again"
                    await asyncio.sleep(0.1)
        finally:
            proxy.delay = 0
            await store.close()


async def test_a_dead_replicas_counts_disappear(namespace: str) -> None:
    dead = await RedisStore.connect(REDIS_URL, namespace=namespace)
    survivor = None
    try:
        taken = [(await route(dead, doc(f"p{n}"))).instance_id for n in range(3)]
        dead.release(taken[0])  # its share now holds a field that went back to 0
        held = {t: taken[1:].count(t) for t in set(taken[1:])}
        assert await settled(dead, held) == held  # its counts are in Redis before it dies
        await dead.stop_tasks()  # dies: no more heartbeats, no goodbye
        await dead.redis.delete(dead.alive_key)  # as if its heartbeat TTL ran out
        survivor = await RedisStore.connect(REDIS_URL, namespace=namespace)
        await survivor.beat()
        assert await survivor.in_flight() == {}
    finally:
        if survivor is not None:
            await survivor.close()
        await dead.stop_tasks()
        await dead.redis.aclose()


async def test_a_replica_reaped_while_alive_writes_its_share_again(namespace: str) -> None:
    """A replica whose loop stalled past its heartbeat's life is reaped by another, its
    counts with it; at its next heartbeat it finds itself out of the set and writes its
    share again, where it used to leave its requests uncounted until they ended."""
    stalled = await RedisStore.connect(REDIS_URL, namespace=namespace)
    survivor = await RedisStore.connect(REDIS_URL, namespace=namespace)
    try:
        taken = [(await route(stalled, doc(f"p{n}"))).instance_id for n in range(3)]
        held = {t: taken.count(t) for t in set(taken)}
        assert await settled(stalled, held) == held
        await stalled.redis.delete(stalled.alive_key)  # its heartbeat's life ran out
        await survivor.beat()  # reaped
        assert await survivor.in_flight() == {}
        await stalled.beat()  # alive after all
        assert await settled(survivor, held) == held
    finally:
        await survivor.close()
        await stalled.close()


async def test_a_failed_round_trip_drops_every_pooled_connection(namespace: str) -> None:
    """When Redis restarts, every connection opened before is dead; one left in the pool
    fails the first round trip that draws it, after fleet-wide routing had resumed: an
    outage after the outage. So a failed round trip closes them all, and the next calls
    connect afresh."""
    store = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    store._tasks[1].cancel()  # no heartbeat: only the test's calls use connections
    client = aioredis.Redis.from_url(REDIS_URL)
    real_sync = store._sync

    async def connected() -> int:
        clients = await client.client_list()
        return sum(1 for c in clients if c["name"] == store.replica)

    try:
        await route(store, doc("a"))
        await asyncio.gather(*(store.redis.client_setname(store.replica) for _ in range(6)))
        assert await connected() >= 2

        async def lost(**_: object) -> bytes:
            store._sync = real_sync
            raise ConnectionError("the round trip is lost")

        store._sync = lost  # type: ignore[method-assign]
        waits = RoutingTable.build(FLEET, CONFIG.patched({"redis_max_staleness_ms": 0}))
        with pytest.raises(StateUnavailable):
            await store.route(key(doc("b")), waits)
        for _ in range(200):
            if await connected() == 0:
                break
            await asyncio.sleep(0.01)
        assert await connected() == 0
        await recovered(store)
        await route(store, doc("c"))  # and the store connects again
    finally:
        await store.close()
        await client.aclose()


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (redis_exceptions.ConnectionError("closed by server"), True),
        (redis_exceptions.TimeoutError("read timed out"), True),
        (ConnectionResetError(104, "reset"), True),
        (TimeoutError(), True),  # asyncio.timeout: the round trip's bound
        (redis_exceptions.ResponseError("ERR script error"), False),  # Redis answered
        (redis_exceptions.NoScriptError("NOSCRIPT"), False),
    ],
)
def test_only_a_failed_connection_drops_the_pool(error: BaseException, lost: bool) -> None:
    assert redis_store._lost_connection(error) is lost


async def test_redis_down_is_reported_within_the_round_trip_timeout() -> None:
    store = await RedisStore.connect("redis://127.0.0.1:1/0", namespace="nowhere:", timeout_s=0.05)
    try:
        with pytest.raises(StateUnavailable):
            async with asyncio.timeout(5.0):  # generous: the store's own bound is 50 ms
                await route(store, doc("x"))
    finally:
        await store.close()


async def test_redis_counts_decisions_keeps_recent_spills_and_bounds_the_index(
    namespace: str,
) -> None:
    store = await RedisStore.connect(REDIS_URL, namespace=namespace, timeout_s=1.0)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        held = [await route(store, doc("hot") + bytes([n]), f"req-{n}") for n in range(9)]
        outcomes = [r.decision.outcome for r in held]
        # held in flight, they fill the holder up to the in-flight bound (1.4 x mean + 2),
        # then go elsewhere
        assert outcomes[:2] == [Outcome.PLACED, Outcome.HOME] and Outcome.SPILLED in outcomes
        for _ in range(200):
            decisions = await client.hgetall(f"{namespace}decisions")
            if sum(int(v) for v in decisions.values()) == 9:
                break
            await asyncio.sleep(0.01)
        assert {k.decode(): int(v) for k, v in decisions.items()} == {
            o.value: outcomes.count(o) for o in set(outcomes)
        }
        spills = [json.loads(s) for s in await client.lrange(f"{namespace}spills", 0, -1)]
        spilled = [r for n, r in enumerate(held) if r.decision.outcome is Outcome.SPILLED]
        assert [s["to"] for s in reversed(spills)] == [r.instance_id for r in spilled]
        assert all(s["time"] > 1.7e9 and s["request_id"].startswith("req-") for s in spills)
        # the holder's in-flight count when each left it: at the bound, so at least 3
        assert all(s["home_in_flight"] >= 3 for s in spills), spills
        for n in range(300):
            await route(store, doc(f"many {n}", 9000))
        assert await client.strlen(f"{namespace}index:12") <= SLOT_BYTES * 2**12
    finally:
        await store.close()
        await client.aclose()


@pytest.mark.parametrize("scale", [1.0, 0.001])
async def test_the_stores_clock_runs_at_the_instances_speed(namespace: str, scale: float) -> None:
    """A simulated fleet at time scale s works s times wall speed: with ``clock_scale``
    the modelled prefill ends are on its clock (Redis's TIME, or the monotonic clock, times
    s), so queues drain as fast as its instances work."""
    slow = RoutingTable.build(
        FLEET, CONFIG.patched({"instance_defaults": {"prefill_tokens_per_s": 1000.0}})
    )
    body = doc("clocked")
    shared = await RedisStore.connect(
        REDIS_URL, namespace=namespace, timeout_s=1.0, clock_scale=scale
    )
    try:
        before = time.time() * scale
        routed = await shared.route(key(body), slow)
        after = time.time() * scale
    finally:
        await shared.close()
    prefill_s = routed.decision.prefill_tokens / 1000.0
    assert before + prefill_s - 0.01 <= routed.prefill_end <= after + prefill_s + 0.01
    local = InProcessStore(scaled_clock(scale))
    before = time.monotonic() * scale
    routed = await local.route(key(body), slow)
    assert before + prefill_s <= routed.prefill_end <= time.monotonic() * scale + prefill_s


@pytest.mark.parametrize(
    ("text", "scale"), [("1", 1.0), ("0.125", 0.125), ("4", 4.0), ("0", None), ("-1", None),
                        ("inf", None), ("nan", None), ("fast", None)]
)  # fmt: skip
def test_a_clock_scale_is_a_positive_number(text: str, scale: float | None) -> None:
    if scale is None:
        with pytest.raises(argparse.ArgumentTypeError, match="positive number"):
            parse_clock_scale(text)
        return
    assert parse_clock_scale(text) == scale
    assert scaled_clock(scale)() == pytest.approx(time.monotonic() * scale, rel=1e-3)


@pytest.mark.parametrize("ended_with_its_blocks", [True, False])
async def test_a_prefix_is_as_recent_as_the_end_of_the_request_that_used_it(
    make_store: StoreFactory, ended_with_its_blocks: bool
) -> None:
    """vLLM keeps what a request used until the request ends: a conversation whose answer
    outlasted a cache's worth of other traffic is still where it was when the answer ends,
    and its next turn is found there, by this replica and by another one."""
    small = CONFIG.patched({"instance_defaults": {"kv_cache_tokens": 3000}})
    table = RoutingTable.build(Fleet.of([Instance("10.0.0.1", 8000)]), small)
    store, other = await make_store(), await make_store()
    turn = doc("conversation") + b"first question"
    first = await store.route(key(turn), table)
    assert first.decision.outcome is Outcome.PLACED
    for n in range(4):  # while the answer is generated, 4 x ~1,000 tokens written there
        routed = await store.route(key(doc(f"other {n}") + b"?"), table)
        store.release(routed.instance_id)
    if isinstance(store, RedisStore):  # releases are written on the replica's copy
        store.release((await fresh(store, doc("warm-up"), table)).instance_id)
        assert store._copy is not None
    blocks = key(turn).blocks if ended_with_its_blocks else ()
    store.release(first.instance_id, first.prefill_end, blocks)
    if isinstance(store, RedisStore):
        assert await settled(store, {}) == {}  # the release and its writes landed
    else:
        other = store
    expected = Outcome.HOME if ended_with_its_blocks else Outcome.PLACED
    for replica in {id(store): store, id(other): other}.values():
        follows = await replica.route(key(turn + b" answer, second question"), table)
        replica.release(follows.instance_id)
        assert follows.decision.outcome is expected


async def test_requests_on_an_instance_that_left_do_not_loosen_the_bound(
    make_store: StoreFactory,
) -> None:
    """The in-flight bound is a multiple of the routable instances' mean: requests still
    running on one that left the fleet (draining, unhealthy) count for neither. The
    in-process store once counted them, so a hot key stayed on its holder far past it."""
    store = await make_store()
    leaving, *staying = FLEET.instances
    only_leaving = RoutingTable.build(Fleet.of([leaving]), CONFIG)
    for n in range(30):
        await store.route(key(doc(f"long {n}")), only_leaving)
    without = RoutingTable.build(Fleet.of(staying), CONFIG)
    chosen = [(await store.route(key(doc("hot")), without)).instance_id for _ in range(8)]
    assert len(set(chosen)) > 1, chosen  # past the bound of the two that stay: spilled
