"""Fleet-wide in-flight counts in Redis, shared by every ext_proc replica.

Layout (``ns`` is the namespace, e.g. ``prefix-router:``):

``{ns}inflight``            hash  instance id -> fleet-wide in-flight count
``{ns}inflight:{replica}``  hash  instance id -> this replica's share of it
``{ns}replicas``            set   replicas that may hold counts
``{ns}alive:{replica}``     key   heartbeat, expires ``HEARTBEAT_TTL_S`` after the last beat
``{ns}decisions``           hash  outcome (home, spilled) -> decisions counted in Redis
``{ns}spills``              list  the last 100 spills, newest first, as JSON
                                  ``{time, home, to, home_in_flight, request_id}``
``{ns}placed:{half}:{gen}`` string  bitfield of prefixes' placed homes, one 32-bit field
                                  per slot, per generation of ``memory_s / 2`` (4 MiB at most)

Reserves and releases are queued and sent by one background task as one Lua
call (one command, one round trip, however many requests it carries): it
applies the releases, then for each reserve reads the candidates' counts,
finds the prefix's home (:mod:`prefix_router.core.placement`, the same rules as
:class:`~prefix_router.core.placement.PlacementMemory`), applies the spill rule (the
same rule as :func:`prefix_router.core.spill.choose`) and increments the chosen
instance in both hashes. A script runs atomically,
so no two replicas can both see an instance below the threshold and both push
it over. (A redis-py pipeline of scripts would cost a second round trip per
batch: it asks ``SCRIPT EXISTS`` before every execute.)

Counts heal themselves: a replica that dies stops beating, and any
replica's janitor (or the control plane's) subtracts the dead replica's share
from the fleet-wide counts within a few seconds. When a round trip fails
outright, the replica rewrites its share from its own exact local counts
before its next batch, in the flusher, so no release or reserve can overtake
the rewrite on another connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from prefix_router.core.placement import Placement
from prefix_router.core.spill import SpillRule
from prefix_router.state.loads.base import LoadsUnavailable, Reservation

log = logging.getLogger("prefix_router.state.loads")

HEARTBEAT_S = 1.0
HEARTBEAT_TTL_S = 3.0

# One round trip: every release, then every reserve, queued since the last one.
# KEYS: fleet hash, replica hash, decisions hash, spills list, placement key prefix.
# ARGV: release count, ids to release (repeats allowed), then per reserve:
#       policy, threshold, load_factor, fleet_size, request id,
#       placement policy, placement width, placement memory_s, slot,
#       candidate count, candidate ids, and unless the placement policy is 'home', their tags.
# Returns per reserve: the candidates' counts before it, the chosen index, the home index.
# Placements (prefix_router.core.placement): generation g of memory_s / 2 seconds is the bitfield
# {prefix}{memory_s / 2}:{g}, one u32 per slot: home tag << 16 | ring pick tag (0: none).
_APPLY = """
local releases = tonumber(ARGV[1])
for i = 2, releases + 1 do
  local id = ARGV[i]
  local left = redis.call('HINCRBY', KEYS[2], id, -1)
  if left <= 0 then redis.call('HDEL', KEYS[2], id) end
  if left >= 0 and redis.call('HINCRBY', KEYS[1], id, -1) <= 0 then
    redis.call('HDEL', KEYS[1], id)
  end
end
local total = nil  -- fleet-wide in flight, read once when relative-load needs it
local now = nil
local function clock()
  if now == nil then
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  end
  return now
end
local written = {}  -- placement generations written: key -> ttl ms
local home, spilled = 0, 0
local out = {}
local pos = releases + 2
while pos <= #ARGV do
  local policy, limit = ARGV[pos], tonumber(ARGV[pos + 1])
  local request_id, n = ARGV[pos + 4], tonumber(ARGV[pos + 9])
  local first = pos + 10
  local raw = redis.call('HMGET', KEYS[1], unpack(ARGV, first, first + n - 1))
  local loads = {}
  for i = 1, n do loads[i] = math.max(0, tonumber(raw[i]) or 0) end
  local s = 1  -- the prefix's home, 1-based
  local next_pos = first + n
  if ARGV[pos + 5] ~= 'home' then
    local tags = first + n  -- ARGV index of the first candidate's tag
    next_pos = tags + n
    local half = tonumber(ARGV[pos + 7]) / 2
    local generation = math.floor(clock() / half)
    local current = KEYS[5] .. half .. ':' .. generation
    local slot = '#' .. ARGV[pos + 8]
    local v = redis.call('BITFIELD', current, 'GET', 'u32', slot)[1]
    local fresh = v ~= 0
    if not fresh then
      v = redis.call('BITFIELD', KEYS[5] .. half .. ':' .. (generation - 1), 'GET', 'u32', slot)[1]
    end
    s = nil
    if v == 0 then  -- a new prefix: the least loaded of the first width candidates
      s = 1
      for i = 2, math.min(tonumber(ARGV[pos + 6]), n) do
        if loads[i] < loads[s] then s = i end
      end
    else
      local home, pick = math.floor(v / 65536), v % 65536
      local taken = false  -- an instance that joined took the key's ring position
      if pick ~= tonumber(ARGV[tags]) then
        fresh = false  -- the pick changed: remember the new one
        for i = 2, n do
          if tonumber(ARGV[tags + i - 1]) == pick then taken = true; break end
        end
      end
      if not taken then
        for i = 1, n do
          if tonumber(ARGV[tags + i - 1]) == home then s = i; break end
        end
      end
    end
    if s == nil then  -- taken by a newcomer, or the home left: where the ring sends it
      s = 1
      fresh = false
    end
    if not fresh then
      local value = tonumber(ARGV[tags + s - 1]) * 65536 + tonumber(ARGV[tags])
      redis.call('BITFIELD', current, 'SET', 'u32', slot, value)
      written[current] = math.ceil(2000 * half)
    end
  end
  local chosen = s
  if policy ~= 'none' then
    if policy == 'relative-load' then
      if total == nil then
        total = 0
        for _, c in ipairs(redis.call('HVALS', KEYS[1])) do
          total = total + math.max(0, tonumber(c))
        end
      end
      local size = math.max(1, tonumber(ARGV[pos + 3]))
      limit = math.max(1, math.ceil(tonumber(ARGV[pos + 2]) * (total + 1) / size))
    end
    if loads[s] >= limit then
      chosen = nil
      for i = 1, n do
        if i ~= s and loads[i] < limit then chosen = i; break end
      end
      if chosen == nil then
        chosen = s
        for i = 1, n do
          if loads[i] < loads[chosen] then chosen = i end
        end
      end
    end
  end
  local id = ARGV[first + chosen - 1]
  redis.call('HINCRBY', KEYS[1], id, 1)
  redis.call('HINCRBY', KEYS[2], id, 1)
  if total ~= nil then total = total + 1 end
  if chosen == s then
    home = home + 1
  else
    spilled = spilled + 1
    redis.call('LPUSH', KEYS[4], cjson.encode({
      time = clock(), home = ARGV[first + s - 1], to = id, home_in_flight = loads[s],
      request_id = request_id}))
  end
  loads[n + 1] = chosen - 1
  loads[n + 2] = s - 1
  out[#out + 1] = loads
  pos = next_pos
end
for key, ttl in pairs(written) do redis.call('PEXPIRE', key, ttl) end
if home > 0 then redis.call('HINCRBY', KEYS[3], 'home', home) end
if spilled > 0 then
  redis.call('HINCRBY', KEYS[3], 'spilled', spilled)
  redis.call('LTRIM', KEYS[4], 0, 99)
end
return out
"""

# KEYS: fleet hash, replica hash. ARGV: id, count, id, count, ... (this replica's exact counts)
_REWRITE_SHARE = """
local old = redis.call('HGETALL', KEYS[2])
for i = 1, #old, 2 do
  local n = tonumber(old[i + 1])
  -- never pass -0: Redis refuses it as an integer and the script would abort
  if n ~= 0 and redis.call('HINCRBY', KEYS[1], old[i], -n) <= 0 then
    redis.call('HDEL', KEYS[1], old[i])
  end
end
redis.call('DEL', KEYS[2])
for i = 1, #ARGV, 2 do
  local c = tonumber(ARGV[i + 1])
  if c > 0 then
    redis.call('HINCRBY', KEYS[1], ARGV[i], c)
    redis.call('HSET', KEYS[2], ARGV[i], c)
  end
end
return 1
"""

# KEYS: fleet hash, replicas set. ARGV: namespace. Removes the shares of replicas without heartbeat.
_REAP = """
local reaped = 0
for _, replica in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[1] .. 'alive:' .. replica) == 0 then
    local share = ARGV[1] .. 'inflight:' .. replica
    local old = redis.call('HGETALL', share)
    for i = 1, #old, 2 do
      local n = tonumber(old[i + 1])
      if n ~= 0 and redis.call('HINCRBY', KEYS[1], old[i], -n) <= 0 then
        redis.call('HDEL', KEYS[1], old[i])
      end
    end
    redis.call('DEL', share)
    redis.call('SREM', KEYS[2], replica)
    reaped = reaped + 1
  end
end
return reaped
"""


class RedisLoadStore:
    """Shared in-flight counts; one replica's view of them.

    Create with :meth:`connect`, which registers the replica and starts its
    heartbeat, janitor and release flusher; :meth:`close` gives back every
    count this replica still holds.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "prefix-router:",
        replica: str | None = None,
        round_trip_timeout_s: float = 0.05,
    ) -> None:
        self.redis = client
        self.round_trip_timeout_s = round_trip_timeout_s
        self.namespace = namespace
        self.replica = replica or uuid.uuid4().hex[:12]
        self.fleet_key = f"{namespace}inflight"
        self.share_key = f"{namespace}inflight:{self.replica}"
        self.replicas_key = f"{namespace}replicas"
        self.alive_key = f"{namespace}alive:{self.replica}"
        self.apply_keys = [
            self.fleet_key,
            self.share_key,
            f"{namespace}decisions",
            f"{namespace}spills",
            f"{namespace}placed:",
        ]
        self._apply = client.register_script(_APPLY)
        self._rewrite = client.register_script(_REWRITE_SHARE)
        self._reap = client.register_script(_REAP)
        self._local: Counter[str] = Counter()
        """This replica's exact counts: what its share in Redis should be."""
        self._pending: list[str] = []
        self._reserves: list[
            tuple[tuple[str | int | float, ...], Sequence[str], asyncio.Future[Reservation]]
        ] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._in_doubt = False
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        namespace: str = "prefix-router:",
        timeout_s: float = 0.05,
        replica: str | None = None,
    ) -> RedisLoadStore:
        """A store on ``url``; works (degraded) even if Redis is down right now."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=max(timeout_s, 0.5),
            socket_connect_timeout=max(timeout_s, 0.2),
            max_connections=256,
            health_check_interval=0,
        )
        store = cls(client, namespace=namespace, replica=replica, round_trip_timeout_s=timeout_s)
        # Load the script now, so the first requests' round trip is not three.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(max(timeout_s, 0.5)):
                await client.script_load(_APPLY)
        store.start()
        return store

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._flush(), name="loads-flusher"),
            asyncio.create_task(self._heartbeat(), name="loads-heartbeat"),
        ]

    async def reserve(
        self,
        candidates: Sequence[str],
        rule: SpillRule,
        fleet_size: int,
        request_id: str = "",
        placement: Placement | None = None,
    ) -> Reservation:
        future: asyncio.Future[Reservation] = asyncio.get_running_loop().create_future()
        args: tuple[str | int | float, ...]
        head = (rule.policy.value, rule.threshold, rule.load_factor, fleet_size, request_id)
        if placement is None or not placement.rule.remembers:
            args = (*head, "home", 0, 0, 0, len(candidates), *candidates)
        else:
            p = placement.rule
            args = (
                *head,
                p.policy.value,
                p.width,
                p.memory_s,
                placement.slot,
                len(candidates),
                *candidates,
                *placement.tags,
            )
        if not self._tasks or self._tasks[0].done():
            raise LoadsUnavailable("the load store is not running")
        self._reserves.append((args, candidates, future))
        self._wake.set()
        return await future

    def release(self, instance_id: str) -> None:
        if self._local[instance_id] > 0:
            self._local[instance_id] -= 1
            self._pending.append(instance_id)
            self._wake.set()

    async def in_flight(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.fleet_key)
        return {_text(k): int(v) for k, v in raw.items() if int(v) > 0}

    async def _flush(self) -> None:
        """Send every queued release and reserve as one script call, repeatedly.

        One command, one round trip, whatever the batch: under load a round trip
        carries many requests, and the Python cost per request is packing its
        arguments. A reserve whose caller gave up waiting (timeout) is still
        counted by Redis, so it is released at once: counts stay exact.

        After a failed round trip the share is in doubt: the next batch starts by
        rewriting it from the local counts, which already reflect the batch's
        releases (so those are not sent again). Rewrite and batch go in order from
        this one task: a rewrite sent by another task could be overtaken by a
        release and then restore the count that release removed.
        """
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            reserves, self._reserves = self._reserves, []
            releases, self._pending = self._pending, []
            if not reserves and not releases and not self._in_doubt:
                continue
            try:
                async with asyncio.timeout(self.round_trip_timeout_s):
                    if self._in_doubt:
                        await self._rewrite_share()
                        self._in_doubt = False
                        releases = []
                    results = []
                    if reserves or releases:
                        args: list[str | int | float] = [len(releases), *releases]
                        for reserve_args, _, _ in reserves:
                            args += reserve_args
                        results = await self._apply(keys=self.apply_keys, args=args)
            except Exception as exc:  # noqa: BLE001 - the flusher must outlive any failure
                # Unknown whether Redis applied them: rewrite the share from local counts later.
                if not isinstance(exc, RedisError | OSError | TimeoutError):
                    log.warning("load store round trip failed unexpectedly: %r", exc)
                self._in_doubt = True
                for _, _, future in reserves:
                    if not future.done():
                        future.set_exception(LoadsUnavailable(repr(exc)))
                continue
            for (_, candidates, future), result in zip(reserves, results, strict=True):
                index, start = int(result[-2]), int(result[-1])
                chosen = candidates[index]
                self._local[chosen] += 1
                if future.done():  # the caller timed out and routed by the ring alone
                    self.release(chosen)
                else:
                    loads = tuple(int(x) for x in result[:-2])
                    future.set_result(Reservation(index=index, loads=loads, start=start))

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
            await pipe.execute()
        await self._reap(keys=[self.fleet_key, self.replicas_key], args=[self.namespace])
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
        self._pending.clear()
        with contextlib.suppress(RedisError, OSError):
            await self._rewrite(keys=[self.fleet_key, self.share_key], args=[])
            await self.redis.srem(self.replicas_key, self.replica)
            await self.redis.delete(self.alive_key)
        await self.redis.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
