"""The Lua the Redis store runs, and the one place its arguments are laid out.

The scripts hold no routing logic: the decision is made in Python by
:func:`prefix_router.core.decision.decide`. They only make each round trip's writes atomic
(an entry of the prefix index changes only if it still holds what the decision read; a
prefill is queued after whatever another replica queued meanwhile) and read what the next
decisions need. :class:`SyncArgs` packs one round trip's arguments; the script reads them
in the same order, section by section, each section led by its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefix_router.core.index import EntryWrite

KEYS = ("inflight", "share", "decisions", "spills", "index", "work")
"""KEYS of :data:`SYNC`, in order (see :class:`~.redis_store.Keys` for the names)."""

ADMIT_FIELDS = (
    "id", "decided_at", "prefill_tokens", "written_tokens", "rate", "outcome", "home", "request"
)  # fmt: skip
"""One routed request in :attr:`SyncArgs.admits`: its prefill to queue and its decision."""


@dataclass(slots=True)
class SyncArgs:
    """One round trip: writes first, then the reads of the next decisions."""

    reserves: list[str] = field(default_factory=list)
    """Instances that took a request since the last round trip: +1 in flight each."""
    releases: list[tuple[str, float]] = field(default_factory=list)
    """Instances whose request ended, with its modelled prefill end: -1 in flight each
    (after the reserves), and the queue corrected (:func:`prefix_router.core.work.finished`)."""
    admits: list[tuple[str, float, float, float, float, str, str, str]] = field(
        default_factory=list
    )
    """:data:`ADMIT_FIELDS` per request routed since the last round trip."""
    writes: list[EntryWrite] = field(default_factory=list)
    instances: Sequence[str] = ()
    slots: Sequence[int] = ()
    keep: int = 256
    """Prefill ends kept per instance (the decision needs ConcurrencyThreshold of them)."""

    def __bool__(self) -> bool:
        return bool(self.reserves or self.releases or self.admits or self.writes or self.slots)

    def pack(
        self, ends_prefix: str, entry_bytes: int, slot_bytes: int
    ) -> list[str | bytes | float]:
        args: list[str | bytes | float] = [ends_prefix, entry_bytes, slot_bytes, self.keep]
        args += [len(self.reserves), *self.reserves]
        args.append(len(self.releases))
        for instance_id, end in self.releases:
            args += [instance_id, end]
        args.append(len(self.admits))
        for admit in self.admits:
            args += admit
        args.append(len(self.writes))
        for w in self.writes:
            args += [w.offset, w.expected, w.new]
        args += [len(self.instances), *self.instances]
        args += [len(self.slots), *self.slots]
        return args


SYNC = """
local ends_prefix = ARGV[1]
local entry_bytes, slot_bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
local keep = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local pos = 5
local function take()
  local v = ARGV[pos]
  pos = pos + 1
  return v
end
local function pad(s, n)
  if #s < n then return s .. string.rep('\\0', n - #s) end
  return s
end
-- reserves, then releases (a request's release may share its reserve's round trip)
for _ = 1, tonumber(take()) do
  local id = take()
  redis.call('HINCRBY', KEYS[1], id, 1)
  redis.call('HINCRBY', KEYS[2], id, 1)
end
-- releases: this replica's share first, the fleet count only if the share had it; a
-- request that ended before its modelled prefill end proves the queue up to it done
for _ = 1, tonumber(take()) do
  local id, done = take(), tonumber(take())
  local left = redis.call('HINCRBY', KEYS[2], id, -1)
  if left <= 0 then redis.call('HDEL', KEYS[2], id) end
  if left >= 0 and redis.call('HINCRBY', KEYS[1], id, -1) <= 0 then
    redis.call('HDEL', KEYS[1], id)
  end
  if done > now then
    local early = done - now  -- the queue behind the request moves up by as much
    local busy = tonumber(redis.call('HGET', KEYS[6], id .. ':busy')) or 0
    redis.call('HSET', KEYS[6], id .. ':busy', tostring(math.max(now, busy - early)))
    local ends = ends_prefix .. id
    local kept = {}
    for _, e in ipairs(redis.call('LRANGE', ends, 0, -1)) do
      if tonumber(e) > done then kept[#kept + 1] = tostring(tonumber(e) - early) end
    end
    redis.call('DEL', ends)
    if #kept > 0 then redis.call('RPUSH', ends, unpack(kept)) end
  end
end
-- admits: queue the prefill after what is queued (any replica's); count the decision
local counted = {}
for _ = 1, tonumber(take()) do
  local id, decided_at = take(), tonumber(take())
  local prefill, written, rate = tonumber(take()), tonumber(take()), tonumber(take())
  local outcome, home, request = take(), take(), take()
  local busy = tonumber(redis.call('HGET', KEYS[6], id .. ':busy')) or 0
  local done = math.max(decided_at, busy) + prefill / rate  -- it arrived when decided
  redis.call('HSET', KEYS[6], id .. ':busy', tostring(done))
  redis.call('HINCRBYFLOAT', KEYS[6], id .. ':written', written)
  local ends = ends_prefix .. id
  redis.call('RPUSH', ends, tostring(done))
  redis.call('LTRIM', ends, -keep, -1)
  counted[outcome] = (counted[outcome] or 0) + 1
  if outcome == 'spilled' then
    redis.call('LPUSH', KEYS[4], cjson.encode({
      time = now, home = home, to = id, request_id = request}))
    redis.call('LTRIM', KEYS[4], 0, 99)
  end
end
for outcome, n in pairs(counted) do redis.call('HINCRBY', KEYS[3], outcome, n) end
-- index entries: compare-and-set, so a concurrent writer's entry is never overwritten
for _ = 1, tonumber(take()) do
  local offset, expected, new = tonumber(take()), take(), take()
  local last = offset + entry_bytes - 1
  local current = pad(redis.call('GETRANGE', KEYS[5], offset, last), entry_bytes)
  if current == expected then redis.call('SETRANGE', KEYS[5], offset, new) end
end
-- reads: each instance's queue and counts, then the index slots asked for
local out = {tostring(now)}
local n = tonumber(take())
local ids = {}
for i = 1, n do ids[i] = take() end
for i = 1, n do
  local id = ids[i]
  local ends = ends_prefix .. id
  local kept = {}
  for _, e in ipairs(redis.call('LRANGE', ends, 0, -1)) do
    if tonumber(e) > now then kept[#kept + 1] = e end
  end
  local all = redis.call('LLEN', ends)
  if #kept < all then redis.call('LTRIM', ends, all - #kept, -1) end
  local work = redis.call('HMGET', KEYS[6], id .. ':busy', id .. ':written')
  out[#out + 1] = (work[1] or '0') .. ' ' .. (work[2] or '0') .. ' '
    .. (redis.call('HGET', KEYS[1], id) or '0') .. ' ' .. table.concat(kept, ' ')
end
for _ = 1, tonumber(take()) do
  local offset = tonumber(take()) * slot_bytes
  out[#out + 1] = pad(redis.call('GETRANGE', KEYS[5], offset, offset + slot_bytes - 1), slot_bytes)
end
return out
"""
"""One round trip (see :class:`SyncArgs`). Returns ``now``; per instance asked for, one
space-separated string: ``busy_until``, ``written_tokens``, fleet-wide in flight, then its
prefill ends still ahead; then each slot."""

REWRITE_SHARE = """
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
"""KEYS: fleet in-flight hash, this replica's share. ARGV: id, count, ... (its exact counts)."""

REAP = """
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
"""KEYS: fleet in-flight hash, replicas set. ARGV: namespace. Removes the shares of replicas
whose heartbeat expired."""
