"""The shared state in Redis: fleet and config, written by the control plane, read by all.

Why Redis: several control-plane replicas and every ext_proc replica must see
one fleet and one config, and a restarted control plane must come back with
them. Redis is already the load store, so it is the one shared place.

Schema (every key under a namespace prefix, default ``prefix-router:``)::

    <ns>fleet      string  JSON {"version": n, "instances": [Instance...],
                                 "removing": [instance id...]}
    <ns>config     string  JSON {"version": n, "config": RouterConfig}
    <ns>changed    pub/sub JSON {"fleet_version": n, "config_version": m}, after every change
    <ns>audit      list    JSON audit entries, newest first, capped at AUDIT_KEEP
    <ns>inflight   hash    instance id -> fleet-wide in-flight count (the load store's)
    <ns>supervision string JSON report of ``prefix-router up``'s supervisor
                           (:mod:`prefix_router.state.supervision`)

``removing`` lists draining instances to delete once drained (a drained but
not removed instance stays in the fleet). Versions start at 1 and grow by one
per change; an absent key reads as version 0 with the defaults.

Writes are optimistic transactions: WATCH the document, compute the new value
with a pure function of the old one, then MULTI: SET, LPUSH the audit entry,
PUBLISH, EXEC. A concurrent writer makes EXEC fail and the change is recomputed
on the new value, so replicas never lose each other's changes and a change and
its audit entry land together or not at all.

Readers (:func:`watch_state`) subscribe to ``<ns>changed`` and also re-read
every ``interval`` seconds, so a missed message (a reconnect, a slow
subscriber) heals within one interval. Every Redis call has a socket timeout.

If Redis loses the documents (restarted empty, flushed), readers keep what
they had instead of taking the absent documents for an empty fleet, and the
control plane writes back the last state it read (:meth:`StateStore.restore`,
``control_plane.restore``) with its versions, so every reader goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from prefix_router.core.config import RouterConfig, parse_config
from prefix_router.core.errors import ConfigError, FleetError, PrefixRouterError
from prefix_router.core.fleet import Fleet

log = logging.getLogger("prefix_router.state.store")
audit_log = logging.getLogger("prefix_router.audit")
"""Every audit entry, once its change has landed in Redis."""

DEFAULT_NAMESPACE = "prefix-router:"
AUDIT_KEEP = 1000
REDIS_TIMEOUT_S = 2.0
WATCH_INTERVAL_S = 1.0
_MAX_RETRIES = 50

T = TypeVar("T")


class StateError(PrefixRouterError):
    """Redis is unreachable, or holds a document this version cannot read."""


@dataclass(frozen=True, slots=True)
class Keys:
    """Every Redis key of one namespace."""

    namespace: str

    @property
    def fleet(self) -> str:
        return f"{self.namespace}fleet"

    @property
    def config(self) -> str:
        return f"{self.namespace}config"

    @property
    def changed(self) -> str:
        return f"{self.namespace}changed"

    @property
    def audit(self) -> str:
        return f"{self.namespace}audit"

    @property
    def inflight(self) -> str:
        return f"{self.namespace}inflight"


@dataclass(frozen=True, slots=True)
class FleetRecord:
    """The fleet document: the fleet and the instances to remove once drained."""

    fleet: Fleet
    removing: frozenset[str] = field(default=frozenset())

    def to_json(self) -> str:
        doc = self.fleet.to_json_dict()
        doc["removing"] = sorted(self.removing)
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> FleetRecord:
        if raw is None:
            return cls(Fleet.of([], version=0))
        try:
            doc = json.loads(raw)
            return cls(Fleet.from_json_dict(doc), frozenset(doc.get("removing") or ()))
        except (ValueError, KeyError, TypeError, FleetError) as exc:
            raise StateError(f"unreadable fleet document in Redis: {exc}") from None


@dataclass(frozen=True, slots=True)
class ConfigRecord:
    """The config document: the config and its version."""

    config: RouterConfig
    version: int

    def to_json(self) -> str:
        return json.dumps(
            {"version": self.version, "config": self.config.to_json_dict()},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> ConfigRecord:
        if raw is None:
            return cls(RouterConfig(), 0)
        try:
            doc = json.loads(raw)
            return cls(parse_config(doc["config"]), int(doc["version"]))
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            raise StateError(f"unreadable config document in Redis: {exc}") from None


@dataclass(frozen=True, slots=True)
class State:
    """One consistent read of both documents."""

    fleet: FleetRecord
    config: ConfigRecord

    @property
    def versions(self) -> tuple[int, int]:
        return (self.fleet.fleet.version, self.config.version)


AuditFn = Callable[[T, T], dict[str, Any]]
"""(before, after) -> the audit entry to store with the change."""


def connect(url: str, *, timeout: float = REDIS_TIMEOUT_S) -> aioredis.Redis:
    """A client whose every wait on Redis is bounded by ``timeout`` seconds."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        health_check_interval=10,
    )


class StateStore:
    """Read and change the shared state of one namespace."""

    def __init__(self, client: aioredis.Redis, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.redis = client
        self.keys = Keys(namespace)
        self._newest: dict[str, Any] = {}
        """Per document, the newest record this store read or wrote. A change to a
        document Redis has lost (restarted empty, flushed) starts from it, not from an
        empty fleet or the default config: otherwise an admin call in the moment before
        :class:`~control_plane.restore.StateKeeper` writes the document back would wipe
        the fleet, and the keeper, finding a document, would restore nothing."""

    def newest(self) -> tuple[FleetRecord | None, ConfigRecord | None]:
        """The fleet and config this store last read or wrote (None: neither yet): what a
        document Redis lost is restored from, since it includes this process's own writes
        made since the last read."""
        return self._newest.get(self.keys.fleet), self._newest.get(self.keys.config)

    @classmethod
    def from_url(cls, url: str, namespace: str = DEFAULT_NAMESPACE) -> StateStore:
        return cls(connect(url), namespace)

    async def close(self) -> None:
        await self.redis.aclose()

    async def read(self) -> State:
        try:
            raw_fleet, raw_config = await self.redis.mget([self.keys.fleet, self.keys.config])
        except (RedisError, OSError) as exc:
            raise StateError(f"cannot read state from Redis: {exc}") from None
        fleet, config = FleetRecord.from_json(raw_fleet), ConfigRecord.from_json(raw_config)
        if raw_fleet is not None:
            self._newest[self.keys.fleet] = fleet
        if raw_config is not None:
            self._newest[self.keys.config] = config
        return State(fleet, config)

    async def seed(self, fleet: Fleet | None, config: RouterConfig | None) -> State:
        """Write the start-up fleet/config only where the namespace has none yet.

        Redis is the source of truth: a restarted control plane keeps what the
        admin API changed rather than going back to its start-up files.
        """
        if fleet is not None:
            record = FleetRecord(Fleet.of(list(fleet.instances), version=1))
            await self._set_if_absent(self.keys.fleet, record.to_json())
        if config is not None:
            await self._set_if_absent(self.keys.config, ConfigRecord(config, 1).to_json())
        return await self.read()

    async def _set_if_absent(self, key: str, value: str) -> None:
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(key, value, nx=True)
                pipe.publish(self.keys.changed, "{}")
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StateError(f"cannot write state to Redis: {exc}") from None

    async def restore(self, fleet: FleetRecord | None, config: ConfigRecord | None) -> bool:
        """Write back documents Redis lost, each only where absent, versions kept.

        For a Redis that restarted empty: ``fleet``/``config`` are the last ones read
        (``None``: nothing to restore). One audit entry says what came back. Returns
        whether anything was written (``False`` if another writer was first).
        """
        keys = (self.keys.fleet, self.keys.config)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(*keys)
                raw_fleet, raw_config = await pipe.mget(list(keys))
                writes: dict[str, str] = {}
                if raw_fleet is None and fleet is not None and fleet.fleet.version > 0:
                    writes[self.keys.fleet] = fleet.to_json()
                if raw_config is None and config is not None and config.version > 0:
                    writes[self.keys.config] = config.to_json()
                if not writes:
                    await pipe.unwatch()  # type: ignore[no-untyped-call]
                    return False
                pipe.multi()  # type: ignore[no-untyped-call]
                for key, value in writes.items():
                    pipe.set(key, value)
                entry = {
                    "time": time.time(),
                    "actor": "control-plane",
                    "action": "restore-state",
                    "target": ",".join(k.removeprefix(self.keys.namespace) for k in writes),
                    "fleet_version": fleet.fleet.version if fleet else None,
                    "config_version": config.version if config else None,
                }
                pipe.lpush(self.keys.audit, json.dumps(entry))
                pipe.ltrim(self.keys.audit, 0, AUDIT_KEEP - 1)
                pipe.publish(self.keys.changed, "restored")
                await pipe.execute()
        except WatchError:
            return False
        except (RedisError, OSError) as exc:
            raise StateError(f"cannot restore state to Redis: {exc}") from None
        return True

    async def update_fleet(
        self,
        change: Callable[[FleetRecord], FleetRecord],
        *,
        audit: AuditFn[FleetRecord] | None = None,
    ) -> tuple[FleetRecord, FleetRecord]:
        """Apply ``change`` atomically; returns (before, after). The version grows by one.

        ``change`` may raise (nothing is written). When it returns an equal
        record, nothing is written and the version stays.
        """

        def bump(before: FleetRecord) -> FleetRecord | None:
            after = change(before)
            if after == before:
                return None
            fleet = Fleet.of(list(after.fleet.instances), version=before.fleet.version + 1)
            return FleetRecord(fleet, after.removing)

        return await self._update(
            self.keys.fleet, FleetRecord.from_json, bump, FleetRecord.to_json, audit
        )

    async def update_config(
        self,
        change: Callable[[RouterConfig], RouterConfig],
        *,
        audit: AuditFn[ConfigRecord] | None = None,
    ) -> tuple[ConfigRecord, ConfigRecord]:
        """Apply ``change`` atomically; returns (before, after). The version grows by one."""

        def bump(before: ConfigRecord) -> ConfigRecord | None:
            config = change(before.config)
            if config == before.config:
                return None
            return ConfigRecord(config, before.version + 1)

        return await self._update(
            self.keys.config, ConfigRecord.from_json, bump, ConfigRecord.to_json, audit
        )

    async def _update(
        self,
        key: str,
        load: Callable[[Any], T],
        change: Callable[[T], T | None],
        dump: Callable[[T], str],
        audit: AuditFn[T] | None,
    ) -> tuple[T, T]:
        try:
            for _ in range(_MAX_RETRIES):
                async with self.redis.pipeline(transaction=True) as pipe:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    before = load(raw) if raw is not None else self._newest.get(key, load(raw))
                    after = change(before)
                    if after is None:
                        await pipe.unwatch()  # type: ignore[no-untyped-call]
                        return before, before
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.set(key, dump(after))
                    entry = None
                    if audit is not None:
                        entry = {"time": time.time(), **audit(before, after)}
                        pipe.lpush(self.keys.audit, json.dumps(entry, default=str))
                        pipe.ltrim(self.keys.audit, 0, AUDIT_KEEP - 1)
                    pipe.publish(self.keys.changed, key)
                    try:
                        await pipe.execute()
                    except WatchError:
                        continue  # the change is made again: its entry too, then logged once
                    self._newest[key] = after
                    if entry is not None:
                        audit_log.info("audit %s", entry)
                    return before, after
        except (RedisError, OSError) as exc:
            raise StateError(f"cannot write state to Redis: {exc}") from None
        raise StateError(f"gave up writing {key}: {_MAX_RETRIES} concurrent changes won")

    async def audit_log(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` audit entries, newest first."""
        try:
            raw = await self.redis.lrange(self.keys.audit, 0, max(0, limit - 1))
        except (RedisError, OSError) as exc:
            raise StateError(f"cannot read the audit log: {exc}") from None
        return [json.loads(r) for r in raw]

    async def in_flight(self) -> dict[str, int]:
        """Fleet-wide in-flight count per instance, from the load store's hash."""
        try:
            raw = await self.redis.hgetall(self.keys.inflight)
        except (RedisError, OSError) as exc:
            raise StateError(f"cannot read in-flight counts: {exc}") from None
        return {_text(k): int(v) for k, v in raw.items()}

    async def delete_namespace(self) -> int:
        """Delete every key of this namespace (tests, ``--reset``). Returns how many."""
        deleted = 0
        async for key in self.redis.scan_iter(match=glob_escape(self.keys.namespace) + "*"):
            deleted += int(await self.redis.delete(key))
        return deleted


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis ``SCAN MATCH`` pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


OnChange = Callable[[Fleet, RouterConfig, int], None | Awaitable[None]]


async def watch_state(
    redis_url: str,
    namespace: str,
    on_change: OnChange,
    *,
    interval: float = WATCH_INTERVAL_S,
    stop: asyncio.Event | None = None,
) -> None:
    """Call ``on_change(fleet, config, config_version)`` on start and on every change.

    Subscribes to ``<ns>changed`` and re-reads at least every ``interval``
    seconds; calls ``on_change`` only when a version moved (again at the next
    wake-up if it raised). A document that was there and is gone (Redis lost
    it) is no change: the caller keeps the last state until one is back. Redis
    errors are logged once per outage and retried; this returns only when
    ``stop`` is set.
    """
    stop = stop or asyncio.Event()
    store = StateStore.from_url(redis_url, namespace)
    last: tuple[int, int] | None = None
    failing = lost = False
    try:
        while not stop.is_set():
            pubsub = store.redis.pubsub()
            try:
                await pubsub.subscribe(store.keys.changed)
                while not stop.is_set():
                    state = await store.read()
                    if failing:
                        failing = False
                        log.warning("shared state readable again")
                    gone = last is not None and any(
                        now == 0 < before for now, before in zip(state.versions, last, strict=True)
                    )
                    if gone and not lost:
                        # A document present before is absent: Redis lost it (restarted
                        # empty). Not an empty fleet: keep the last state until it is back.
                        lost = True
                        log.warning(
                            "shared state gone from Redis (restarted empty?); keeping "
                            "fleet v%d / config v%d until it is restored",
                            *(last or (0, 0)),
                        )
                    elif not gone and lost:
                        lost = False
                        log.warning(
                            "shared state back in Redis: fleet v%d / config v%d", *state.versions
                        )
                    if not gone and state.versions != last:
                        try:
                            result = on_change(
                                state.fleet.fleet, state.config.config, state.config.version
                            )
                            if result is not None:
                                await result
                            last = state.versions
                        except Exception:  # the follower must outlive a bad callback
                            log.exception("applying state %s failed; retrying", state.versions)
                    await _next_message(pubsub, interval, stop)
            except (StateError, RedisError, OSError) as exc:
                if not failing:
                    failing = True
                    log.warning("cannot follow shared state (%s); retrying", exc)
                await _sleep_or_stop(stop, min(interval, 0.5))
            finally:
                try:
                    await asyncio.wait_for(pubsub.aclose(), REDIS_TIMEOUT_S)  # type: ignore[no-untyped-call]
                except (RedisError, OSError, TimeoutError):
                    pass
    finally:
        await store.close()


async def _next_message(pubsub: Any, interval: float, stop: asyncio.Event) -> None:
    """Wait for a change message, ``interval`` or ``stop``; swallow queued duplicates."""
    deadline = time.monotonic() + interval
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        message = await pubsub.get_message(
            ignore_subscribe_messages=True, timeout=min(remaining, 0.25)
        )
        if message is not None:
            while await pubsub.get_message(ignore_subscribe_messages=True, timeout=0):
                pass
            return


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
