"""The routing state in Redis, shared by every ext_proc replica.

Layout (``ns`` is the namespace, e.g. ``prefix-router:``):

``{ns}inflight``            hash    instance id -> fleet-wide in-flight count
``{ns}inflight:{replica}``  hash    instance id -> this replica's share of it
``{ns}replicas``            set     replicas that may hold counts
``{ns}alive:{replica}``     key     heartbeat, expires ``HEARTBEAT_TTL_S`` after the last beat
``{ns}decisions``           hash    outcome (home, placed, spilled) -> decisions counted here
``{ns}spills``              list    the last 100 spills, newest first, as JSON
                                    ``{time, home, to, request_id}``
``{ns}index:{slots_log2}``  string  the prefix index (:mod:`prefix_router.core.index`):
                                    ``32 x 2**slots_log2`` bytes at most (8 MiB at 18)
``{ns}work``                hash    ``{id}:busy``, ``{id}:written`` and ``{id}:queue`` of each
                                    instance's prefill queue (:mod:`prefix_router.core.work`);
                                    queue: its last prefill ends (ConcurrencyThreshold, 256 if
                                    off) as packed float64s (``redis_lua.QUEUE_FORMAT``; one
                                    field, not a list of its own: the script reads every
                                    instance's queue in one HMGET)
``{ns}models``              hash    instance id -> ``rate capacity [waiting observed_at]``,
                                    learned by the control plane (``core.work.model_text``)

One background task sends everything as one script call per round trip (:mod:`.redis_lua`):
the writes of the requests routed since the last one, then the reads the waiting requests'
decisions need (each instance's queue and counts, the index slots of their blocks). The
requests are then decided in order in Python, each seeing the ones before it, and their
writes ride on the next round trip (within ``WRITE_DELAY_S``, whether or not a request
waits). So a request waits for one round trip, however many share it.

Replicas see each other's decisions one round trip late, so two may both send a request
to an instance that one alone would have considered full: the bounds are soft by that
much. The writes themselves are atomic: a prefill is queued after whatever is queued when
it lands, and an index entry changes only if it still holds what the decision read.

Counts heal themselves as before: a replica that dies stops beating, and any replica's
janitor (or the control plane's) subtracts the dead replica's share from the fleet-wide
counts within a few seconds. When a round trip fails outright, the replica rewrites its
share from its own exact local counts before its next batch, in the flusher, so no
release can overtake the rewrite on another connection. A write sent before the outage
can still land after that rewrite (a frozen server reads what waits in its sockets when
it thaws, in no set order), so the share is rewritten once more ``SETTLE_S`` later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from prefix_router.core.decision import Decision, Load, Outcome
from prefix_router.core.index import (
    CacheModel,
    apply,
    locate,
)
from prefix_router.core.key import PrefixKey
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import InstanceModel, InstanceWork, admit, model_of_text
from prefix_router.state.routing.base import Routed, StateUnavailable
from prefix_router.state.routing.redis_lua import (
    REAP,
    REWRITE_SHARE,
    SYNC,
    SyncArgs,
    queue_ahead,
    unpack_reply,
)

log = logging.getLogger("prefix_router.state.routing")

HEARTBEAT_S = 1.0
HEARTBEAT_TTL_S = 3.0
SETTLE_S = 1.0
"""After an outage, how long after the first successful rewrite of the share it is
rewritten again, to undo writes of the outage that the server applied late."""
WRITE_DELAY_S = 0.002
"""Longest a write (a release, a routed request's index entries and counts) waits for a
round trip to ride on; other replicas see it that much later at most."""


@dataclass(slots=True)
class _Waiting:
    key: PrefixKey
    table: RoutingTable
    request_id: str
    future: asyncio.Future[Routed]


class RedisStore:
    """The fleet's routing state in Redis; one replica's view of it.

    Create with :meth:`connect`, which registers the replica and starts its heartbeat,
    janitor and flusher; :meth:`close` gives back every count this replica still holds.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "prefix-router:",
        replica: str | None = None,
        round_trip_timeout_s: float = 0.05,
        clock_scale: float = 1.0,
    ) -> None:
        self.redis = client
        self.clock_scale = clock_scale
        """Seconds of the instances' clock per second of Redis's: 1 for vLLM; a simulated
        fleet at time scale s runs s times wall speed, and the queues the store models
        (prefill ends, backlogs) must drain at the speed its instances work."""
        self.round_trip_timeout_s = round_trip_timeout_s
        self.namespace = namespace
        self.replica = replica or uuid.uuid4().hex[:12]
        self.fleet_key = f"{namespace}inflight"
        self.share_key = f"{namespace}inflight:{self.replica}"
        self.replicas_key = f"{namespace}replicas"
        self.alive_key = f"{namespace}alive:{self.replica}"
        self.models_key = f"{namespace}models"
        self._sync = client.register_script(SYNC)
        self._rewrite = client.register_script(REWRITE_SHARE)
        self._reap = client.register_script(REAP)
        self._local: Counter[str] = Counter()
        """This replica's exact counts: what its share in Redis should be."""
        self._next = SyncArgs()
        """Writes for the next round trip."""
        self._waiting: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._in_doubt = False
        self._outage = False
        """A round trip failed since the last rewrite: the next one is followed by another."""
        self._settle_at: float | None = None
        """When (loop time) to rewrite the share once more after an outage, if pending."""
        self._tasks: list[asyncio.Task[None]] = []
        self._last_keys: list[str] = []
        """KEYS of the last table's round trip, for one that carries only writes."""
        self._last_slots_log2 = -1
        """The index size ``_last_keys`` name (the only part of them a table changes)."""
        self._write_timer: asyncio.TimerHandle | None = None
        self._learned: dict[str, InstanceModel] = {}
        """The instance models the control plane learned, re-read with every heartbeat."""
        self._models: tuple[RoutingTable | None, dict[str, InstanceModel], list[InstanceModel]]
        self._models = (None, self._learned, [])
        """The last table's instance models, as of the last learned models."""

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        namespace: str = "prefix-router:",
        timeout_s: float = 0.05,
        replica: str | None = None,
        clock_scale: float = 1.0,
    ) -> RedisStore:
        """A store on ``url``; works (degraded) even if Redis is down right now."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=max(timeout_s, 0.5),
            socket_connect_timeout=max(timeout_s, 0.2),
            max_connections=256,
            health_check_interval=0,
        )
        store = cls(
            client,
            namespace=namespace,
            replica=replica,
            round_trip_timeout_s=timeout_s,
            clock_scale=clock_scale,
        )
        # Load the script now, so the first requests' round trip is not three.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(max(timeout_s, 0.5)):
                await client.script_load(SYNC)
        store.start()
        return store

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._flush(), name="routing-state-flusher"),
            asyncio.create_task(self._heartbeat(), name="routing-state-heartbeat"),
        ]

    def keys_for(self, table: RoutingTable) -> list[str]:
        ns = self.namespace
        return [
            self.fleet_key,
            self.share_key,
            f"{ns}decisions",
            f"{ns}spills",
            f"{ns}index:{table.rule.slots_log2}",
            f"{ns}work",
        ]

    async def route(self, key: PrefixKey, table: RoutingTable, request_id: str = "") -> Routed:
        if not self._tasks or self._tasks[0].done():
            raise StateUnavailable("the routing store is not running")
        future: asyncio.Future[Routed] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(key, table, request_id, future))
        self._wake.set()
        return await future

    def release(self, instance_id: str, prefill_end: float = 0.0) -> None:
        if self._local[instance_id] > 0:
            self._local[instance_id] -= 1
            self._next.releases.append((instance_id, prefill_end))
            self._wake_soon()

    async def in_flight(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.fleet_key)
        return {_text(k): int(v) for k, v in raw.items() if int(v) > 0}

    async def _flush(self) -> None:
        """Send the pending writes and the waiting requests' reads as one script call,
        decide the waiting requests, repeat (see the module docstring)."""
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            waiting, self._waiting = self._waiting, []
            args, self._next = self._next, SyncArgs()
            if self._write_timer is not None:  # what it would send goes now
                self._write_timer.cancel()
                self._write_timer = None
            if not waiting and not args and not self._in_doubt:
                continue
            table = waiting[-1].table if waiting else None
            if table is not None:
                args.instances = table.ids
                args.keep = table.rule.waiting_kept
                args.slots = sorted(
                    {locate(b, table.rule.slots_log2)[0] for w in waiting for b in w.key.blocks}
                )
            try:
                async with asyncio.timeout(self.round_trip_timeout_s):
                    if self._in_doubt:
                        await self._rewrite_share()
                        self._in_doubt = False
                        if self._outage:
                            self._outage = False
                            self._settle_at = asyncio.get_running_loop().time() + SETTLE_S
                        args.reserves, args.releases = [], []  # the rewrite carries them
                    reply = None
                    if table is not None and table.rule.slots_log2 != self._last_slots_log2:
                        self._last_keys = self.keys_for(table)
                        self._last_slots_log2 = table.rule.slots_log2
                    if args and self._last_keys:
                        keys = self._last_keys
                        reply = await self._sync(keys=keys, args=[args.pack(self.clock_scale)])
            except Exception as exc:  # noqa: BLE001 - the flusher must outlive any failure
                if not isinstance(exc, RedisError | OSError | TimeoutError):
                    log.warning("routing store round trip failed unexpectedly: %r", exc)
                self._in_doubt = True  # unknown whether the writes landed: rewrite the share
                self._outage = True
                for w in waiting:
                    if not w.future.done():
                        w.future.set_exception(StateUnavailable(repr(exc)))
                continue
            if table is not None and reply is not None:
                self._decide(waiting, table, args, reply)
            if self._next:
                self._wake_soon()

    def _wake_soon(self) -> None:
        """Send the pending writes within ``WRITE_DELAY_S``: with the next request's read if
        one comes sooner (one round trip for both), on their own otherwise."""
        if self._write_timer is None or self._write_timer.cancelled():
            self._write_timer = asyncio.get_running_loop().call_later(
                WRITE_DELAY_S, self._timed_wake
            )

    def _timed_wake(self) -> None:
        self._write_timer = None
        self._wake.set()

    def _decide(
        self, waiting: list[_Waiting], table: RoutingTable, args: SyncArgs, reply: bytes
    ) -> None:
        view = _BatchView(table, args, reply, self._models_for(table))
        for w in waiting:
            if w.future.done():  # the caller gave up waiting and routed on its own
                continue
            if w.table is not table:  # swapped mid-batch: decide it next round trip
                self._waiting.append(w)
                self._wake.set()
                continue
            decision, ring_order = table.decide(w.key, view)
            chosen = table.ids[decision.instance]
            rate = view.model(decision.instance).prefill_tokens_per_s
            view.record(decision, rate, table.rule.waiting_kept)
            self._next.writes += decision.index_writes
            home = "" if decision.home is None else table.ids[decision.home]
            self._next.admits.append(
                (
                    chosen,
                    view.now,
                    float(decision.prefill_tokens),
                    float(decision.written_tokens),
                    rate,
                    decision.outcome.value,
                    home,
                    w.request_id,
                )
            )
            self._next.reserves.append(chosen)
            self._local[chosen] += 1
            end = view.prefill_end(decision.instance)
            w.future.set_result(Routed(decision, chosen, ring_order, end))

    def _models_for(self, table: RoutingTable) -> list[InstanceModel]:
        """Each of the table's instances' model: learned where the control plane learned
        it (what it did not learn taken from the defaults), else the defaults. Kept until
        the table or the learned models change (a heartbeat re-reads them)."""
        cached_table, learned, models = self._models
        if cached_table is table and learned is self._learned:
            return models
        default = table.default_model
        models = [
            InstanceModel(
                m.prefill_tokens_per_s or default.prefill_tokens_per_s,
                m.kv_cache_tokens or default.kv_cache_tokens,
                m.waiting,
            )
            if (m := self._learned.get(i))
            else default
            for i in table.ids
        ]
        self._models = (table, self._learned, models)
        return models

    async def _heartbeat(self) -> None:
        while not self._closing:
            try:
                await self.beat()
            except RedisError as exc:
                log.debug("heartbeat failed: %r", exc)
            await asyncio.sleep(HEARTBEAT_S)

    async def beat(self) -> None:
        """Refresh this replica's heartbeat, reap dead replicas; wake the flusher to
        repair a doubtful share on a replica that has no traffic."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.alive_key, b"1", px=int(HEARTBEAT_TTL_S * 1000))
            pipe.sadd(self.replicas_key, self.replica)
            pipe.hgetall(self.models_key)
            *_, models = await pipe.execute()
        now = time.time()  # the control plane stamps the waiting counts on the wall clock
        self._learned = {_text(k): model_of_text(v, now) for k, v in models.items()}
        await self._reap(keys=[self.fleet_key, self.replicas_key], args=[self.namespace])
        if self._settle_at is not None and asyncio.get_running_loop().time() >= self._settle_at:
            self._settle_at = None
            self._in_doubt = True
        if self._in_doubt:
            self._wake.set()

    async def _rewrite_share(self) -> None:
        args: list[str | int] = []
        for instance_id, count in self._local.items():
            if count > 0:
                args += [instance_id, count]
        await self._rewrite(keys=[self.fleet_key, self.share_key], args=args)

    async def stop_tasks(self) -> None:
        """Stop the flusher and the heartbeat, and wait (boundedly) until they have.

        The loops also check a flag: a cancellation swallowed inside a Redis call
        must not leave a heartbeat running forever.
        """
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2 * HEARTBEAT_S)

    async def close(self) -> None:
        """Stop the background tasks and give back every count this replica holds."""
        await self.stop_tasks()
        self._local.clear()
        self._next = SyncArgs()
        with contextlib.suppress(RedisError, OSError):
            await self._rewrite(keys=[self.fleet_key, self.share_key], args=[])
            await self.redis.srem(self.replicas_key, self.replica)
            await self.redis.delete(self.alive_key)
        await self.redis.aclose()


class _BatchView:
    """What one round trip read, as the batch's decisions see it: each decision's writes
    are applied here too, so the next request of the batch sees them."""

    __slots__ = ("now", "_table", "_slots", "_read", "_works", "_in_flight", "_models", "_total")

    def __init__(
        self,
        table: RoutingTable,
        args: SyncArgs,
        reply: bytes,
        models: list[InstanceModel],
    ) -> None:
        now, self._read, slots = unpack_reply(reply, len(args.instances))
        self.now = float(now)
        self._table = table
        self._works: list[InstanceWork | None] = [None] * len(self._read)
        """Each instance's queue, parsed when a decision first asks (a handful of a fleet's
        instances are a request's candidates or hold its blocks)."""
        self._in_flight = [max(0, int(r[2])) for r in self._read]
        self._models = models
        self._total = sum(self._in_flight)
        self._slots = dict(zip(args.slots, slots, strict=True))

    def _work(self, instance: int) -> InstanceWork:
        work = self._works[instance]
        if work is None:
            busy, written, _, queue = self._read[instance]
            work = InstanceWork(float(busy), queue_ahead(queue, self.now), float(written))
            self._works[instance] = work
        return work

    def slot(self, slot: int) -> bytes:
        return self._slots[slot]

    def model(self, instance: int) -> InstanceModel:
        return self._models[instance]

    def load(self, instance: int) -> Load:
        work, now = self._work(instance), self.now
        return (
            work.backlog_s(now),
            self._models[instance].waiting_with(work, now),
            self._in_flight[instance],
            self._models[instance].prefill_tokens_per_s,
        )

    def total_in_flight(self) -> int:
        return self._total

    def prefill_end(self, instance: int) -> float:
        """The instance's modelled prefill end, as of the last decision recorded here."""
        return self._work(instance).busy_until

    def cache_model(self, tag: int) -> CacheModel | None:
        instance = self._table.instance_of_tag.get(tag)
        if instance is None:
            return None
        return CacheModel.of(
            self._work(instance).written_tokens, self._models[instance].kv_cache_tokens
        )

    def record(self, decision: Decision, rate: float, keep: int) -> None:
        for write in decision.index_writes:
            self._slots[write.slot] = apply(self._slots[write.slot], write)
        i = decision.instance
        self._works[i] = admit(
            self._work(i),
            self.now,
            prefill_tokens=decision.prefill_tokens,
            written_tokens=decision.written_tokens,
            rate=rate,
            keep=keep,
        )
        self._in_flight[i] += 1
        self._total += 1


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["HEARTBEAT_S", "HEARTBEAT_TTL_S", "Outcome", "RedisStore"]
