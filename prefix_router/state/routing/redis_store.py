"""The routing state in Redis, shared by every ext_proc replica.

Layout (``ns`` is the namespace, e.g. ``prefix-router:``):

``{ns}inflight``            hash    instance id -> fleet-wide in-flight count
``{ns}inflight:{replica}``  hash    instance id -> this replica's share of it
``{ns}replicas``            set     replicas that may hold counts
``{ns}alive:{replica}``     key     heartbeat, expires ``HEARTBEAT_TTL_S`` after the last beat
``{ns}decisions``           hash    outcome (home, placed, spilled) -> decisions counted here
``{ns}spills``              list    the last 100 spills, newest first, as JSON
                                    ``{time, home, to, home_in_flight, request_id}``
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
``{ns}index-seq:{slots_log2}``  int  index entries written so far
``{ns}index-log:{slots_log2}``  list  the last ``redis_lua.LOG_KEEP`` of them, newest first:
                                    each written entry's offset and what it holds after

One background task sends everything as one script call per round trip (:mod:`.redis_lua`):
the writes of the requests routed since the last one, then the reads the decisions need
(each instance's queue and counts, and what changed in the index). Requests are decided in
Python, each seeing the ones before it, and their writes ride on the next round trip
(within ``WRITE_DELAY_S``, whether or not a request waits).

Each replica keeps a **copy** of what it decides on: the whole index (8 MiB at the default
size), kept current from the index log the script appends to (what each entry written
holds after the write), and the last round trip's read of every instance's queue and
counts, with this replica's own decisions and releases since applied on top. A request
is decided on the copy at once, with no round trip, while the copy was refreshed within
``redis_max_staleness_ms`` (10 ms by default; traffic refreshes it every
``WRITE_DELAY_S``, and an idle replica every ``REFRESH_S``); past that it waits for one
round trip, which refreshes it, as every request did before the copy (and does with the
setting at 0, or an index over ``COPY_MAX_SLOTS_LOG2``). A replica that falls further
behind than the log keeps loads the index again in the background, its requests waiting
for their round trip meanwhile; so does one whose round trip failed.

Replicas thus see each other's decisions up to ``WRITE_DELAY_S`` plus their copy's age
late, so two may both send a request to an instance that one alone would have considered
full: the bounds are soft by that much. The writes themselves are atomic: a prefill is
queued after whatever is queued when it lands, and an index entry changes only if it still
holds what the decision read.

Counts heal themselves as before: a replica that dies stops beating, and any replica's
janitor (or the control plane's) subtracts the dead replica's share from the fleet-wide
counts within a few seconds. When a round trip fails outright, the replica rewrites its
share from its own exact local counts before its next batch, in the flusher, so no
release can overtake the rewrite on another connection. A write sent before the outage
can still land after that rewrite (a frozen server reads what waits in its sockets when
it thaws, in no set order), so the share is rewritten once more ``SETTLE_S`` later. A
failed call also closes every pooled connection (a restarted Redis leaves each of them
dead), and the flusher pauses one round trip's timeout before it tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefix_router.core.decision import Decision, Outcome, release_writes
from prefix_router.core.index import (
    ENTRY_BYTES,
    SLOT_BYTES,
    CacheModel,
    EntryWrite,
    apply,
    locate,
)
from prefix_router.core.key import PrefixKey
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import (
    InstanceModel,
    InstanceWork,
    Load,
    admit,
    finished,
    model_of_text,
)
from prefix_router.state.routing.base import Routed, StateUnavailable
from prefix_router.state.routing.redis_lua import (
    LOG_RECORD,
    REAP,
    REWRITE_SHARE,
    SYNC,
    InstanceRead,
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
WRITE_DELAY_S = 0.005
"""Longest a write (a release, a routed request's index entries and counts) waits for a
round trip to ride on; other replicas see it that much later at most. Each round trip
costs the replica ~150-250 us of CPU, most of it waking Redis: at 2 ms a replica serving
one request every ~2 ms made one per request, and its CPU a request with the state in
Redis was +470-560 us over in-process; at 5 ms, +320-360 us (``decision_latency.py``'s
paced row). A refresh of the copy is still due within ``redis_max_staleness_ms``."""
COPY_MAX_SLOTS_LOG2 = 20
"""Largest index a replica keeps a copy of (32 MiB); a larger one is read slot by slot, each
request waiting for its round trip."""
RELOAD_TIMEOUT_S = 2.0
"""Longest the copy of the whole index may take to load (8 MiB at the default size)."""
RELOAD_BACKOFF_S = 1.0
"""Least time between two loads of the copy."""
REFRESH_S = 0.1
"""Longest a replica keeping a copy goes without a round trip, traffic or not, so that it
stays within the index log (``redis_lua.LOG_KEEP`` of the whole fleet's index writes)."""
CONNECT_TIMEOUT_S = 2.0
"""Longest the flusher waits, after a failed round trip, for a new connection (a PING)
before its next round trip; requests meanwhile route on the replica's own state."""


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
        self._flusher_client = client.client()
        """One connection of the pool kept for the flusher's round trips: drawing one from
        the pool for each (a lock, a check that it has nothing unread) costs about a
        quarter of the call's CPU. Its calls never overlap; one cut short by the timeout
        disconnects it (redis-py), so no reply is read by the wrong call."""
        self._sync = self._flusher_client.register_script(SYNC)
        self._rewrite = self._flusher_client.register_script(REWRITE_SHARE)
        self._reap = client.register_script(REAP)
        self._local: Counter[str] = Counter()
        """This replica's exact counts: what its share in Redis should be."""
        self._next = SyncArgs()
        """Writes for the next round trip."""
        self._waiting: list[_Waiting] = []
        self._recovering = False
        self._wake = asyncio.Event()
        self._closing = False
        self._in_doubt = False
        self._beaten = False
        """A heartbeat has put this replica in the set of replicas already."""
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
        self._table: RoutingTable | None = None
        """The table of the latest request: what a round trip with no request waiting
        reads for the copy."""
        self._copy: _IndexCopy | None = None
        """This replica's copy of the prefix index (None: not loaded, or not kept)."""
        self._view: _BatchView | None = None
        """The last round trip's read with every decision since recorded on it: what a
        request decides on at once while it is fresh (None: wait for a round trip)."""
        self._view_at = 0.0
        """Loop time the last round trip's read arrived."""
        self._view_now = 0.0
        """That read's ``now`` (Redis's clock, scaled)."""
        self._reloading: asyncio.Task[None] | None = None
        self._reload_after = 0.0
        self.decided_at_once = 0
        """Requests decided on the copy, without waiting for a round trip."""
        self.decided_after_round_trip = 0

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
            socket_timeout=max(timeout_s, 1.0),  # the largest redis_timeout_ms a config may set
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
        # Load the script and connect the flusher now, so the first requests' round trip
        # is one, not a connection's handshake and three.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await client.script_load(SYNC)
        await store._connect()
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
            f"{ns}index-seq:{table.rule.slots_log2}",
            f"{ns}index-log:{table.rule.slots_log2}",
        ]

    def route_at_once(
        self, key: PrefixKey, table: RoutingTable, request_id: str = ""
    ) -> Routed | None:
        """The request decided on this replica's copy, if it is fresh (see the module
        docstring); None: it must wait for a round trip (:meth:`route`)."""
        if not self._tasks or self._tasks[0].done():
            return None
        self._table = table
        view = self._view
        if view is None or view.table is not table or self._in_doubt:
            return None
        age = asyncio.get_running_loop().time() - self._view_at
        if age > table.config.redis_max_staleness_ms / 1000:
            return None
        view.now = self._view_now + age * self.clock_scale
        self.decided_at_once += 1
        return self._decide_one(key, table, view, request_id)

    async def route(self, key: PrefixKey, table: RoutingTable, request_id: str = "") -> Routed:
        if not self._tasks or self._tasks[0].done():
            raise StateUnavailable("the routing store is not running")
        if self._recovering:
            raise StateUnavailable("recovering from a failed round trip")
        routed = self.route_at_once(key, table, request_id)
        if routed is not None:
            return routed
        future: asyncio.Future[Routed] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(key, table, request_id, future))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            # the caller gave up in the very turn its reservation was made (a future
            # resolved before the cancel still cancels the waiter): nobody else will
            # give that count back
            if future.done() and not future.cancelled() and future.exception() is None:
                routed = future.result()
                self.release(routed.instance_id, routed.prefill_end)
            raise

    def release(
        self, instance_id: str, prefill_end: float = 0.0, blocks: Sequence[int] = ()
    ) -> None:
        """See :class:`~prefix_router.state.routing.base.RoutingStore`. The index writes
        for ``blocks`` are made on the copy of the index, so a replica without one (an
        index over ``COPY_MAX_SLOTS_LOG2``, ``redis_max_staleness_ms`` 0) makes none."""
        if self._local[instance_id] > 0:
            self._local[instance_id] -= 1
            self._next.releases.append((instance_id, prefill_end))
            view = self._view
            if view is not None:  # the next decision on it sees the request gone
                age = asyncio.get_running_loop().time() - self._view_at
                view.release(instance_id, self._view_now + age * self.clock_scale, prefill_end)
                if blocks:
                    self._next.writes += view.record_release(instance_id, blocks)
            self._wake_soon()

    async def in_flight(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.fleet_key)
        return {_text(k): int(v) for k, v in raw.items() if int(v) > 0}

    async def _flush(self) -> None:
        """Send the pending writes and the waiting requests' reads as one script call,
        decide the waiting requests, repeat (see the module docstring)."""
        while not self._closing:
            refresh = self._copy is not None and _keeps_copy(self._table)
            if refresh:  # keep a copy within the log even with no traffic of its own
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(REFRESH_S):
                        await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake.clear()
            waiting, self._waiting = self._waiting, []
            args, self._next = self._next, SyncArgs()
            if self._write_timer is not None:  # what it would send goes now
                self._write_timer.cancel()
                self._write_timer = None
            if not waiting and not args and not self._in_doubt and not refresh:
                continue
            table = waiting[-1].table if waiting else None
            copying = False
            if _keeps_copy(table or self._table):
                table = table or self._table
                assert table is not None
                copying = self._copy_serves(table)
                if not copying:
                    self._start_reload(table)
            elif table is not None:
                self._copy = self._view = None
            if table is not None:
                args.instances = table.ids
                args.keep = table.rule.waiting_kept
                if copying:
                    assert self._copy is not None
                    args.log_from = self._copy.seq
                else:
                    args.slots = _slots_of(waiting, table)
            try:  # each round trip bounded on its own: a slow Redis is not a down one
                if self._in_doubt:
                    await self._bounded(self._rewrite_share())
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
                    reply = await self._bounded(
                        self._sync(keys=self._last_keys, args=[args.pack(self.clock_scale)])
                    )
                if table is not None and reply is not None:
                    view = self._read(table, args, reply)
                    if view is None:  # the copy fell behind the log: read the slots
                        args = SyncArgs(
                            instances=table.ids,
                            keep=table.rule.waiting_kept,
                            slots=_slots_of(waiting, table),
                        )
                        reply = await self._bounded(
                            self._sync(keys=self._last_keys, args=[args.pack(self.clock_scale)])
                        )
                        view = self._read(table, args, reply)
            except Exception as exc:  # noqa: BLE001 - the flusher must outlive any failure
                if not isinstance(exc, RedisError | OSError | TimeoutError):
                    log.warning("routing store round trip failed unexpectedly: %r", exc)
                self._in_doubt = True  # unknown whether the writes landed: rewrite the share
                self._outage = True
                self._copy = self._view = None  # nor which: load the index again
                # until the next round trip, requests route on the replica's own state:
                # none may wait out the recovery (Envoy waits for an answer only so long)
                self._recovering = True
                waiting += self._waiting
                self._waiting = []
                for w in waiting:
                    if not w.future.done():
                        w.future.set_exception(StateUnavailable(repr(exc)))
                try:
                    if _lost_connection(exc):
                        await self._drop_connections()
                    await asyncio.sleep(self.round_trip_timeout_s)  # not a retry every few ms
                    await self._connect()
                finally:
                    self._recovering = False
                continue
            if table is not None and reply is not None and view is not None:
                try:
                    self._decide(waiting, table, view)
                except Exception as exc:  # noqa: BLE001 - a bug must not stop the flusher
                    log.exception("deciding a batch failed")
                    for w in waiting:
                        if not w.future.done():
                            w.future.set_exception(StateUnavailable(repr(exc)))
            if self._next:
                self._wake_soon()

    async def _bounded(self, call: Awaitable[Any]) -> Any:
        """``call``, one round trip, within ``round_trip_timeout_s``."""
        async with asyncio.timeout(self.round_trip_timeout_s):
            return await call

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

    def _read(self, table: RoutingTable, args: SyncArgs, reply: bytes) -> _BatchView | None:
        """The round trip's read as a view to decide on. With the copy of the index (the
        round trip read the log), the copy brought up to date and the view kept for
        deciding at once; None if the copy fell behind the log (a reload starts)."""
        now, read, slots, log = unpack_reply(reply, len(args.instances))
        copy = self._copy if args.log_from >= 0 else None
        if copy is not None:
            if log is None or log.entries is None or len(log.entries) % LOG_RECORD.size:
                # Behind the log, or the log went back (Redis lost its data without the
                # connection dropping): reload the index, and write this replica's share
                # of the counts again in case they went too.
                self._copy = self._view = None
                self._in_doubt = True
                self._start_reload(table)
                return None
            copy.catch_up(log.seq, log.entries)
            for write in self._next.writes:  # this replica's, made during the round trip
                copy.set(write.offset, write.new)
        view = _BatchView(table, args, now, read, slots, self._models_for(table), copy)
        view.replay(self._next, table.rule.waiting_kept)
        if copy is not None:
            self._view, self._view_now = view, view.now
            self._view_at = asyncio.get_running_loop().time()
        return view

    def _decide(self, waiting: list[_Waiting], table: RoutingTable, view: _BatchView) -> None:
        for w in waiting:
            if w.future.done():  # the caller gave up waiting and routed on its own
                continue
            if w.table is not table:  # swapped mid-batch: decide it next round trip
                self._waiting.append(w)
                self._wake.set()
                continue
            self.decided_after_round_trip += 1
            w.future.set_result(self._decide_one(w.key, table, view, w.request_id))

    def _decide_one(
        self, key: PrefixKey, table: RoutingTable, view: _BatchView, request_id: str
    ) -> Routed:
        """Decide one request on ``view``, record it there and queue its writes."""
        decision, ring_order = table.decide(key, view)
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
                request_id,
            )
        )
        self._next.reserves.append(chosen)
        self._local[chosen] += 1
        self._wake_soon()
        return Routed(decision, chosen, ring_order, view.prefill_end(decision.instance))

    def _copy_serves(self, table: RoutingTable) -> bool:
        return self._copy is not None and self._copy.slots_log2 == table.rule.slots_log2

    def _start_reload(self, table: RoutingTable) -> None:
        """Load the copy of the index in the background (requests meanwhile wait for
        their round trip, as without a copy); at most once per ``RELOAD_BACKOFF_S``."""
        now = asyncio.get_running_loop().time()
        if (self._reloading is not None and not self._reloading.done()) or (
            now < self._reload_after
        ):
            return
        self._reload_after = now + RELOAD_BACKOFF_S
        self._reloading = asyncio.create_task(self._reload(table), name="routing-index-copy")

    async def _reload(self, table: RoutingTable) -> None:
        """Load the whole index and the log's position, atomically, as this replica's copy."""
        keys = self.keys_for(table)
        try:
            async with asyncio.timeout(RELOAD_TIMEOUT_S):
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.get(keys[6])
                    pipe.get(keys[4])
                    seq, raw = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            log.info("loading the index copy failed (%r); requests wait for Redis", exc)
            return
        copy = _IndexCopy(table.rule.slots_log2, int(seq or 0), raw or b"")
        for write in self._next.writes:  # routed while it loaded, not yet sent
            copy.set(write.offset, write.new)
        self._copy, self._view = copy, None
        self._wake.set()  # a round trip that reads the log from here

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
            except (RedisError, OSError) as exc:
                log.debug("heartbeat failed: %r", exc)
                if _lost_connection(exc):
                    await self._drop_connections()
            await asyncio.sleep(HEARTBEAT_S)

    async def beat(self) -> None:
        """Refresh this replica's heartbeat, reap dead replicas; wake the flusher to
        repair a doubtful share on a replica that has no traffic."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.alive_key, b"1", px=int(HEARTBEAT_TTL_S * 1000))
            pipe.sadd(self.replicas_key, self.replica)
            pipe.hgetall(self.models_key)
            _, added, models = await pipe.execute()
        if added and self._beaten:
            # This replica was not in the set any more: another one reaped it (this loop
            # stalled past the heartbeat's life) or Redis lost its data. Its share of the
            # in-flight counts went with it: write it again.
            self._in_doubt = True
        self._beaten = True
        now = time.time()  # the control plane stamps the waiting counts on the wall clock
        self._learned = {_text(k): model_of_text(v, now) for k, v in models.items()}
        if self._view is not None:  # decisions on it from now on use what was learned
            self._view.models = self._models_for(self._view.table)
        await self._reap(keys=[self.fleet_key, self.replicas_key], args=[self.namespace])
        if self._settle_at is not None and asyncio.get_running_loop().time() >= self._settle_at:
            self._settle_at = None
            self._in_doubt = True
        if self._in_doubt:
            self._wake.set()

    async def _drop_connections(self) -> None:
        """Close every pooled connection after a failed call: when Redis restarts, each
        connection opened before is dead, and one kept in the pool would fail the first
        round trip that draws it, an outage after the outage (each one half a second of
        routing on this replica's own state). The next calls connect afresh."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.round_trip_timeout_s):
                await self.redis.connection_pool.disconnect()

    async def _connect(self) -> None:
        """Open a connection before the next bounded round trip. A new connection's
        handshake takes round trips of its own (AUTH, CLIENT SETINFO): counted against
        the bound, a Redis slower than a third of it would fail every round trip after
        the first failure, and never be used again."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await self._flusher_client.ping()

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
        tasks = [*self._tasks, *([self._reloading] if self._reloading else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2 * HEARTBEAT_S)

    async def close(self) -> None:
        """Stop the background tasks and give back every count this replica holds."""
        await self.stop_tasks()
        self._local.clear()
        self._next = SyncArgs()
        with contextlib.suppress(RedisError, OSError):
            await self._rewrite(keys=[self.fleet_key, self.share_key], args=[])
            await self.redis.srem(self.replicas_key, self.replica)
            await self.redis.delete(self.alive_key)
        await self._flusher_client.aclose()
        await self.redis.aclose()


def _lost_connection(exc: BaseException) -> bool:
    """Whether a failed call says the connection failed (not Redis answering an error)."""
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError | TimeoutError)


def _slots_of(waiting: list[_Waiting], table: RoutingTable) -> list[int]:
    """The index slots the waiting requests' blocks fall in."""
    return sorted({locate(b, table.rule.slots_log2)[0] for w in waiting for b in w.key.blocks})


def _keeps_copy(table: RoutingTable | None) -> bool:
    """Whether requests routed with ``table`` decide on a copy of the index."""
    return (
        table is not None
        and table.config.redis_max_staleness_ms > 0
        and table.rule.slots_log2 <= COPY_MAX_SLOTS_LOG2
    )


class _IndexCopy:
    """This replica's copy of the prefix index: Redis's as of the index log's ``seq``,
    with the writes of this replica not yet sent applied on top.

    Every round trip that writes index entries logs what each entry holds after it (the
    script's compare-and-set decides; ``redis_lua.LOG_RECORD``), and every round trip of
    a replica keeping a copy reads the log since its ``seq``: applied in order, the copy
    is what Redis held then. A replica further behind than the log keeps loads the whole
    index again."""

    __slots__ = ("slots_log2", "seq", "_data")

    def __init__(self, slots_log2: int, seq: int, raw: bytes) -> None:
        self.slots_log2 = slots_log2
        self.seq = seq
        self._data = bytearray(SLOT_BYTES << slots_log2)
        n = min(len(raw), len(self._data))
        self._data[:n] = raw[:n]

    def read(self, slot: int) -> bytes:
        start = slot * SLOT_BYTES
        return bytes(self._data[start : start + SLOT_BYTES])

    def set(self, offset: int, value: bytes) -> None:
        self._data[offset : offset + ENTRY_BYTES] = value

    def catch_up(self, seq: int, entries: bytes) -> None:
        """Apply the log's ``entries`` after ``self.seq`` (oldest first), up to ``seq``."""
        data, size = self._data, len(self._data)
        for offset, value in LOG_RECORD.iter_unpack(entries):
            if offset + ENTRY_BYTES <= size:
                data[offset : offset + ENTRY_BYTES] = value
        self.seq = seq


class _BatchView:
    """What one round trip read, as the decisions after it see it: each decision's writes
    are applied here too, so the next one sees them. The prefix index is read from the
    round trip's slots, or from this replica's copy of it."""

    __slots__ = (
        "now",
        "table",
        "_slots",
        "_copy",
        "_read",
        "_works",
        "_in_flight",
        "models",
        "_total",
    )

    def __init__(
        self,
        table: RoutingTable,
        args: SyncArgs,
        now: float,
        read: list[InstanceRead],
        slots: list[bytes],
        models: list[InstanceModel],
        copy: _IndexCopy | None = None,
    ) -> None:
        self.now = float(now)
        self.table = table
        self._read = read
        self._works: list[InstanceWork | None] = [None] * len(self._read)
        """Each instance's queue, parsed when a decision first asks (a handful of a fleet's
        instances are a request's candidates or hold its blocks)."""
        self._in_flight = [max(0, int(r[2])) for r in self._read]
        self.models = models
        self._total = sum(self._in_flight)
        self._slots = dict(zip(args.slots, slots, strict=True))
        self._copy = copy

    def _work(self, instance: int) -> InstanceWork:
        work = self._works[instance]
        if work is None:
            busy, written, _, queue = self._read[instance]
            work = InstanceWork(float(busy), queue_ahead(queue, self.now), float(written))
            self._works[instance] = work
        return work

    def slot(self, slot: int) -> bytes:
        if self._copy is not None:
            return self._copy.read(slot)
        return self._slots[slot]

    def model(self, instance: int) -> InstanceModel:
        return self.models[instance]

    def load(self, instance: int) -> Load:
        return self.models[instance].load(self._work(instance), self.now, self._in_flight[instance])

    def total_in_flight(self) -> int:
        return self._total

    def prefill_end(self, instance: int) -> float:
        """The instance's modelled prefill end, as of the last decision recorded here."""
        return self._work(instance).busy_until

    def cache_model(self, tag: int) -> CacheModel | None:
        instance = self.table.instance_of_tag.get(tag)
        if instance is None:
            return None
        return CacheModel.of(
            self._work(instance).written_tokens, self.models[instance].kv_cache_tokens
        )

    def record(self, decision: Decision, rate: float, keep: int) -> None:
        for write in decision.index_writes:
            if self._copy is not None:
                self._copy.set(write.offset, write.new)
            else:
                self._slots[write.slot] = apply(self._slots[write.slot], write)
        self._admit(
            decision.instance,
            self.now,
            decision.prefill_tokens,
            decision.written_tokens,
            rate,
            keep,
        )

    def replay(self, pending: SyncArgs, keep: int) -> None:
        """Record what this replica did after the round trip was sent (not in its read):
        the requests it routed, then those that ended."""
        index_of = self.table.index_of
        for chosen, decided_at, prefill, written, rate, *_ in pending.admits:
            i = index_of.get(chosen)
            if i is not None:
                self._admit(i, decided_at, prefill, written, rate, keep)
        for instance_id, end in pending.releases:
            self.release(instance_id, self.now, end)

    def record_release(self, instance_id: str, blocks: Sequence[int]) -> tuple[EntryWrite, ...]:
        """The index writes of a request on ``instance_id`` with ``blocks`` ending now
        (:func:`~prefix_router.core.decision.release_writes`), applied to the copy of the
        index; none without a copy (the round trip read only its decisions' slots)."""
        i = self.table.index_of.get(instance_id)
        if self._copy is None or i is None:
            return ()
        writes = release_writes(blocks, self.table.tags[i], self, self.table.rule.slots_log2)
        for write in writes:
            self._copy.set(write.offset, write.new)
        return writes

    def release(self, instance_id: str, now: float, end: float) -> None:
        """A request on ``instance_id`` ended at ``now`` (its prefill modelled to ``end``),
        as the script applies it."""
        i = self.table.index_of.get(instance_id)
        if i is None:
            return
        if self._in_flight[i] > 0:
            self._in_flight[i] -= 1
            self._total -= 1
        self._works[i] = finished(self._work(i), now, end)

    def _admit(
        self, i: int, at: float, prefill: float, written: float, rate: float, keep: int
    ) -> None:
        self._works[i] = admit(
            self._work(i), at, prefill_tokens=prefill, written_tokens=written, rate=rate, keep=keep
        )
        self._in_flight[i] += 1
        self._total += 1


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["HEARTBEAT_S", "HEARTBEAT_TTL_S", "Outcome", "RedisStore"]
