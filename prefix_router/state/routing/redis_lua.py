"""The Lua the Redis store runs, and the one place its arguments are laid out.

The scripts hold no routing logic: the decision is made in Python by
:func:`prefix_router.core.decision.decide`. They only make each round trip's writes atomic
(an entry of the prefix index changes only if it still holds what the decision read; a
prefill is queued after whatever another replica queued meanwhile) and read what the next
decisions need. :class:`SyncArgs` packs one round trip's arguments into one MessagePack
blob, which the script unpacks with Redis's ``cmsgpack``; the reply comes back the same
way. One blob each way, packed and unpacked in C: an argument or a reply field of its own
cost redis-py and the store a Python call or more each, a third of the CPU a request
through the Redis store took (~45 arguments a round trip).
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack

from prefix_router.core.index import ENTRY_BYTES, SLOT_BYTES, EntryWrite

KEYS = ("inflight", "share", "decisions", "spills", "index", "work", "index_seq", "index_log")
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
    log_from: int = -1
    """Return the index log after this sequence number (-1: not at all; see :data:`SYNC`)."""

    def __bool__(self) -> bool:
        return bool(
            self.reserves or self.releases or self.admits or self.writes or self.slots
        ) or bool(self.instances)

    def pack(self, clock_scale: float = 1.0) -> bytes:
        """The script's ``ARGV[1]``; ``clock_scale`` multiplies Redis's clock (see
        :attr:`~.redis_store.RedisStore.clock_scale`). Strings go as MessagePack's raw
        type (``cmsgpack`` in Redis 7 reads no bin type); an :class:`EntryWrite` goes as
        its fields."""
        packed: bytes = msgpack.packb(
            (
                ENTRY_BYTES,
                SLOT_BYTES,
                self.keep,
                self.reserves,
                self.releases,
                self.admits,
                self.writes,
                self.instances,
                self.slots,
                clock_scale,
                self.log_from,
                LOG_KEEP,
            ),
            use_bin_type=False,
        )
        return packed


QUEUE_FORMAT = ">d"
"""An instance's prefill ends in the work hash (``{id}:queue``): ascending big-endian
float64s, one string. Stored binary so the script never parses a queue entry by entry:
with text (one ``tonumber`` per end, for every instance, on every round trip) a round trip
over 8 instances cost Redis 185 us of script at 16 waiting requests each and 1.7 ms at
256; the reads now return each queue whole and a write finds its place by binary search.
"""
_ORDER, _KIND = QUEUE_FORMAT[0], QUEUE_FORMAT[1]
_ENTRY = struct.calcsize(QUEUE_FORMAT)

InstanceRead = tuple[float, float, int, bytes]
"""One instance as :data:`SYNC` read it: ``busy_until``, ``written_tokens``, fleet-wide in
flight, and its prefill ends as stored (:data:`QUEUE_FORMAT`; those already passed
included: see :func:`queue_ahead`). Numbers as MessagePack carries them: an integral one
as an int."""


def queue_ahead(raw: bytes, now: float) -> tuple[float, ...]:
    """The prefill ends of a stored queue (:data:`QUEUE_FORMAT`) that lie after ``now``. A
    trailing partial entry (not written by this code) is ignored."""
    n = len(raw) // _ENTRY
    ends = struct.unpack(f"{_ORDER}{n}{_KIND}", raw[: n * _ENTRY])  # one C call for all
    return ends[bisect_right(ends, now) :]


LOG_KEEP = 65536
"""Entries the index log keeps (``index_log``, one :data:`LOG_RECORD` each: ~1.5 MB in
Redis): a replica further behind than this reloads the whole index. A replica reads the
log at least every ``redis_store.REFRESH_S``, so this holds 650,000 index writes a second
across the fleet."""

LOG_RECORD = struct.Struct(">I8s")
"""One entry of the index log: its byte offset in the index and what it holds now (the
write's new bytes if the compare-and-set took, else what held it)."""


class LogRead(NamedTuple):
    """The index log as one round trip read it."""

    seq: int
    """The log's sequence number: index entries written so far."""
    entries: bytes | None
    """The :data:`LOG_RECORD` entries after the position asked for, oldest first; None:
    the log no longer holds them all (reload the index)."""


def unpack_reply(
    reply: bytes, instances: int
) -> tuple[float, list[InstanceRead], list[bytes], LogRead | None]:
    """:data:`SYNC`'s reply: ``now``, each of the ``instances`` asked for, each slot, and
    the index log if it was asked for."""
    now, log, *read = msgpack.unpackb(reply, raw=True)
    log_read = None
    if log:
        seq, entries = log
        # false: the log no longer holds them; an empty Lua table packs as {} or []
        log_read = LogRead(
            int(seq), None if entries is False else b"".join(reversed(list(entries)))
        )
    return now, read[:instances], read[instances:], log_read


SYNC = """
local a = cmsgpack.unpack(ARGV[1])
local entry_bytes, slot_bytes, keep = a[1], a[2], a[3]
local t = redis.call('TIME')
local wall = tonumber(t[1]) + tonumber(t[2]) / 1e6
local now = wall * (a[10] or 1)
local function pad(s, n)
  if #s < n then return s .. string.rep('\\0', n - #s) end
  return s
end
-- an instance's prefill ends: one field of the work hash, ascending, each a big-endian
-- float64 (QUEUE_FORMAT). Kept binary so that no round trip parses a queue entry by entry:
-- reads return the field whole, writes find their place by binary search
local D = 8
local function count(s) return math.floor(#s / D) end
local function passed(s, t)  -- how many ends are at or before t
  local lo, hi = 0, count(s)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if struct.unpack('>d', s, mid * D + 1) <= t then lo = mid + 1 else hi = mid end
  end
  return lo
end
local function shifted(s, by)  -- every end moved by `by` seconds, a chunk per C call
  local out, n = {}, count(s)
  for first = 0, n - 1, 200 do
    local k = math.min(200, n - first)
    local v = {struct.unpack('>' .. string.rep('d', k), s, first * D + 1)}
    for j = 1, k do v[j] = v[j] + by end
    out[#out + 1] = struct.pack('>' .. string.rep('d', k), unpack(v, 1, k))
  end
  return table.concat(out)
end
-- reserves, then releases (a request's release may share its reserve's round trip)
for _, id in ipairs(a[4]) do
  redis.call('HINCRBY', KEYS[1], id, 1)
  redis.call('HINCRBY', KEYS[2], id, 1)
end
-- releases: this replica's share first, the fleet count only if the share had it; a
-- request that ended before its modelled prefill end proves the queue up to it done
for _, release in ipairs(a[5]) do
  local id, done = release[1], release[2]
  local left = redis.call('HINCRBY', KEYS[2], id, -1)
  if left <= 0 then redis.call('HDEL', KEYS[2], id) end
  if left >= 0 and redis.call('HINCRBY', KEYS[1], id, -1) <= 0 then
    redis.call('HDEL', KEYS[1], id)
  end
  if done > now then
    local early = done - now  -- the queue behind the request moves up by as much
    local work = redis.call('HMGET', KEYS[6], id .. ':busy', id .. ':queue')
    local busy = tonumber(work[1]) or 0
    local queue = work[2] or ''
    local ahead = shifted(string.sub(queue, passed(queue, done) * D + 1), -early)
    redis.call('HSET', KEYS[6], id .. ':busy', tostring(math.max(now, busy - early)),
      id .. ':queue', ahead)
  end
end
-- admits: queue the prefill after what is queued (any replica's); count the decision
local counted = {}
for _, admit in ipairs(a[6]) do
  local id, decided_at, prefill, written, rate = admit[1], admit[2], admit[3], admit[4], admit[5]
  local outcome, home, request = admit[6], admit[7], admit[8]
  local work = redis.call('HMGET', KEYS[6], id .. ':busy', id .. ':queue')
  local busy = tonumber(work[1]) or 0
  local done = math.max(decided_at, busy) + prefill / rate  -- it arrived when decided
  local queue = work[2] or ''
  -- those still ahead, then this one, the last keep of them (the queue only grows at
  -- its end, so those still ahead are the latest)
  queue = string.sub(queue, passed(queue, now) * D + 1) .. struct.pack('>d', done)
  keep = math.max(1, keep)
  if count(queue) > keep then queue = string.sub(queue, #queue - keep * D + 1) end
  redis.call('HSET', KEYS[6], id .. ':busy', tostring(done), id .. ':queue', queue)
  redis.call('HINCRBYFLOAT', KEYS[6], id .. ':written', written)
  counted[outcome] = (counted[outcome] or 0) + 1
  if outcome == 'spilled' then
    -- the wall clock's time (the page shows it), and the home's fleet-wide in flight
    redis.call('LPUSH', KEYS[4], cjson.encode({
      time = wall, home = home, to = id, request_id = request,
      home_in_flight = tonumber(redis.call('HGET', KEYS[1], home)) or 0}))
    redis.call('LTRIM', KEYS[4], 0, 99)
  end
end
for outcome, n in pairs(counted) do redis.call('HINCRBY', KEYS[3], outcome, n) end
-- index entries: compare-and-set, so a concurrent writer's entry is never overwritten;
-- what each entry holds after it goes to the index log, from which replicas that decide on
-- a copy of the index (redis_store) keep it current
local logged = {}
for _, w in ipairs(a[7]) do  -- EntryWrite: slot, way, expected, new
  local offset, expected, new = w[1] * slot_bytes + w[2] * entry_bytes, w[3], w[4]
  local last = offset + entry_bytes - 1
  local current = pad(redis.call('GETRANGE', KEYS[5], offset, last), entry_bytes)
  if current == expected then
    redis.call('SETRANGE', KEYS[5], offset, new)
    current = new
  end
  logged[#logged + 1] = struct.pack('>I', offset) .. current
end
if #logged > 0 then  -- one list element per entry: the log is bounded in entries (bytes)
  redis.call('INCRBY', KEYS[7], #logged)
  for first = 1, #logged, 1000 do
    redis.call('LPUSH', KEYS[8], unpack(logged, first, math.min(first + 999, #logged)))
  end
  redis.call('LTRIM', KEYS[8], 0, a[12] - 1)
end
-- reads: each instance's queue and counts, then the index slots asked for (one HMGET
-- per hash for all the instances: a redis.call costs more than its work here); a queue
-- goes back as stored, ends already passed included (the reader skips them)
local out = {tonumber(tostring(now)), false}  -- now: as a string would carry it
-- the index log's entries after a[11], newest first; false if it no longer holds them
if a[11] >= 0 then
  local seq = tonumber(redis.call('GET', KEYS[7])) or 0
  local behind = seq - a[11]
  local entries = false
  if behind == 0 then
    entries = {}
  elseif behind > 0 and behind <= a[12] then
    entries = redis.call('LRANGE', KEYS[8], 0, behind - 1)
    if #entries < behind then entries = false end
  end
  out[2] = {seq, entries}
end
local ids = a[8]
if #ids > 0 then
  local fields = {}
  for i, id in ipairs(ids) do
    fields[3 * i - 2], fields[3 * i - 1], fields[3 * i] = id .. ':busy', id .. ':written',
      id .. ':queue'
  end
  local work = redis.call('HMGET', KEYS[6], unpack(fields))
  local counts = redis.call('HMGET', KEYS[1], unpack(ids))
  for i = 1, #ids do
    out[#out + 1] = {tonumber(work[3 * i - 2]) or 0, tonumber(work[3 * i - 1]) or 0,
      tonumber(counts[i]) or 0, work[3 * i] or ''}
  end
end
for _, slot in ipairs(a[9]) do
  local offset = slot * slot_bytes
  out[#out + 1] = pad(redis.call('GETRANGE', KEYS[5], offset, offset + slot_bytes - 1), slot_bytes)
end
return cmsgpack.pack(out)
"""
"""One round trip. ARGV: :meth:`SyncArgs.pack`. Returns one
MessagePack blob (:func:`unpack_reply`): ``now``; the index log (false unless asked
for); per instance asked for, ``busy_until``, ``written_tokens``, fleet-wide in flight and
its queue as stored; then each slot."""

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
