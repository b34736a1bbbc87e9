"""The prefix index: which instances recently computed which prompt blocks.

A request's prompt is cut into blocks named by chained hashes (:mod:`.key`), so a block's
name stands for the whole prefix up to its end, as vLLM names its KV blocks. When a request
is routed, its blocks are recorded against the instance that takes it; the next request
that starts the same way finds, block by block, who holds how much of its prefix.

Layout: a fixed table of ``2**slots_log2`` slots, addressed by the top bits of a block's
hash. A slot holds ``WAYS`` entries (set-associative, like a CPU cache), each 8 bytes::

    tag u16 | fingerprint u16 | stamp u32        (big-endian)

``tag`` is the instance's 16-bit identity (:func:`identity_tag`, 0 = empty), the
fingerprint is 16 more bits of the block's hash (so blocks sharing a slot rarely match each
other: 4 ways x 2**-16 per lookup), and ``stamp`` is how much the instance had written to
its KV cache when it last used the block (:mod:`.work`, in units of ``STAMP_TOKENS``).

Forgetting models eviction: an instance's cache holds ``capacity`` tokens and evicts the
least recently used first, so an entry whose instance has written more than ``capacity``
tokens since its stamp is gone from that cache (:func:`is_fresh`). A request uses its blocks
until it ends (vLLM frees them then, to the back of its eviction queue), so its entries are
stamped when it is routed and again when it ends
(:func:`prefix_router.core.decision.release_writes`). vLLM frees a request's
blocks tail first, so a cached block's parents are cached too; a holder's depth is
therefore its deepest fresh entry along the request's chain.

Memory is fixed whatever the traffic: ``2**slots_log2 x WAYS x 8`` bytes (8 MiB at the
default 18), kept in one Redis string so every ext_proc replica shares it, or in a
``bytearray`` in process. An entry is replaced by the stalest of its slot (empty first,
then departed instances, then the most turned-over cache). Replacement lives here, in
Python only; the Redis store applies a write only if the entry still holds what was read
(compare-and-set per entry), so concurrent replicas may lose an update but never mix one.

Cost: a lookup reads one slot per block and an insert writes one entry per new block.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import xxhash

WAYS = 4
ENTRY_BYTES = 8
SLOT_BYTES = WAYS * ENTRY_BYTES
STAMP_TOKENS = 16
"""Tokens per stamp unit: a 32-bit stamp wraps after 68 billion tokens written."""
STAMP_MASK = 0xFFFFFFFF
REFRESH_FRACTION = 0.25
"""An entry is rewritten once its instance has turned over this share of its cache since
the stamp, so a hot prefix stays fresh at a few writes per cache turnover."""

_ENTRY = struct.Struct(">HHI")
_SLOT = struct.Struct(">" + "HHI" * WAYS)
_WAY_STARTS = tuple(range(0, 3 * WAYS, 3))
EMPTY_ENTRY = bytes(ENTRY_BYTES)


def identity_tag(ring_key: str) -> int:
    """A 16-bit, never-zero tag of an instance's ring identity (0 marks an empty entry)."""
    return 1 + xxhash.xxh64_intdigest(ring_key.encode()) % 0xFFFF


def locate(block_hash: int, slots_log2: int) -> tuple[int, int]:
    """``(slot, fingerprint)`` of a block: the hash's top bits and its low 16 bits."""
    return block_hash >> (64 - slots_log2), block_hash & 0xFFFF


def stamp_of(written_tokens: float) -> int:
    """The stamp for an instance that has written ``written_tokens`` to its cache."""
    return int(written_tokens // STAMP_TOKENS) & STAMP_MASK


class CacheModel(NamedTuple):
    """What the index needs of one instance: how much it has written, and holds; kept in
    stamp units so a lookup compares integers."""

    stamp: int
    """The instance's current stamp (:func:`stamp_of` its written tokens)."""
    capacity: int
    """Its KV cache size in stamp units."""

    @classmethod
    def of(cls, written_tokens: float, capacity_tokens: float) -> CacheModel:
        return cls(stamp_of(written_tokens), max(1, int(capacity_tokens // STAMP_TOKENS)))

    def is_fresh(self, stamp: int) -> bool:
        return (self.stamp - stamp) & STAMP_MASK < self.capacity

    def turnover(self, stamp: int) -> float:
        """Share of the cache written since ``stamp`` (>= 1: evicted)."""
        return ((self.stamp - stamp) & STAMP_MASK) / self.capacity


def entries(slot: bytes) -> list[tuple[int, int, int]]:
    """The slot's ``(tag, fingerprint, stamp)`` entries, empty ones included."""
    v = _SLOT.unpack(slot)
    return [(v[w], v[w + 1], v[w + 2]) for w in _WAY_STARTS]


ModelOf = Callable[[int], "CacheModel | None"]
"""The cache model of the instance with this tag, or None if it is not in the fleet."""


class Match(NamedTuple):
    """What the fleet holds of one request's prefix."""

    depths: dict[int, int]
    """Each holder's depth in blocks (by tag): its deepest fresh entry along the chain."""
    common: int = 0
    """Depth in blocks of the prefix so widely held that every instance is assumed to
    hold it: each of its blocks fills all ``WAYS`` entries of its slot with fresh holders
    (a shared system prompt, a hot document). Computing it once more costs little next to
    its popularity, and without this the first few holders would take every request
    that starts with it."""


def match(slots: Sequence[bytes], fingerprints: Sequence[int], model_of: ModelOf) -> Match:
    """The request's :class:`Match`; ``slots[j]`` is the slot of its block ``j``."""
    found: dict[int, int] = {}
    common = 0
    unpack = _SLOT.unpack
    for j, slot in enumerate(slots):
        fp = fingerprints[j]
        v = unpack(slot)
        holders = 0
        for w in _WAY_STARTS:
            tag = v[w]
            if tag and v[w + 1] == fp:
                model = model_of(tag)
                if model is not None and (model.stamp - v[w + 2]) & STAMP_MASK < model.capacity:
                    found[tag] = j + 1
                    holders += 1
        if holders == WAYS and common == j:
            common = j + 1
    return Match(found, common)


class EntryWrite(NamedTuple):
    """Set entry ``way`` of ``slot`` to ``new``, if it still holds ``expected``."""

    slot: int
    way: int
    expected: bytes
    new: bytes

    @property
    def offset(self) -> int:
        """Byte offset of the entry in the table."""
        return self.slot * SLOT_BYTES + self.way * ENTRY_BYTES


def record(
    slot_index: int,
    slot: bytes,
    fp: int,
    tag: int,
    model: CacheModel,
    model_of: ModelOf,
    *,
    force: bool = False,
) -> EntryWrite | None:
    """The write that records ``tag`` as holding the block, or None if it needs none.

    An entry of ``tag`` for the block is refreshed once it is a quarter stale (or always
    with ``force``: the request's deepest block, so a holder's depth stays exact). Otherwise
    the stalest entry of the slot is replaced: empty, then a departed instance's, then
    the one whose cache turned over most since its stamp.
    """
    v = _SLOT.unpack(slot)
    for way, w in enumerate(_WAY_STARTS):
        if v[w] == tag and v[w + 1] == fp:
            stamp = v[w + 2]
            if stamp == model.stamp or (not force and model.turnover(stamp) < REFRESH_FRACTION):
                return None
            start = way * ENTRY_BYTES
            new = _ENTRY.pack(tag, fp, model.stamp)
            return EntryWrite(slot_index, way, slot[start : start + ENTRY_BYTES], new)
    victim, worst = 0, -1.0
    for way, w in enumerate(_WAY_STARTS):
        entry_tag = v[w]
        if not entry_tag:
            victim = way
            break
        holder = model_of(entry_tag)
        staleness = 2.0 if holder is None else min(1.5, holder.turnover(v[w + 2]))
        if staleness > worst:
            victim, worst = way, staleness
    start = victim * ENTRY_BYTES
    new = _ENTRY.pack(tag, fp, model.stamp)
    return EntryWrite(slot_index, victim, slot[start : start + ENTRY_BYTES], new)


def apply(slot: bytes, write: EntryWrite) -> bytes:
    """``slot`` with ``write`` applied (unconditionally: the caller read the slot)."""
    start = write.way * ENTRY_BYTES
    return slot[:start] + write.new + slot[start + ENTRY_BYTES :]


class InProcessIndex:
    """The index table in this process's memory (one replica, degraded mode, simulation)."""

    def __init__(self, slots_log2: int) -> None:
        self.slots_log2 = slots_log2
        self._table: dict[int, bytes] = {}
        """Only slots ever written: a dict is smaller than the whole table until it fills."""

    def read(self, slot: int) -> bytes:
        return self._table.get(slot, _EMPTY_SLOT)

    def write(self, write: EntryWrite) -> None:
        current = self.read(write.slot)
        start = write.way * ENTRY_BYTES
        if current[start : start + ENTRY_BYTES] == write.expected:
            self._table[write.slot] = apply(current, write)

    def __len__(self) -> int:
        return len(self._table)


_EMPTY_SLOT = bytes(SLOT_BYTES)

ReadSlot = Callable[[int], bytes]
"""Reads one slot of the table by its index."""
