"""Placement: which ring candidate becomes a new prefix's home.

Hashing alone picks a prefix's home blind to load. For a prefix already in use
that is right: its KV cache is there. For a prefix nobody has sent lately it
costs balance and buys nothing, since no instance caches it yet; with many
such prefixes (one-off prompts, a hot prefix sharing its home with cold ones)
the blind pick queues requests behind each other that round robin would have
spread. So the ``least-loaded`` policy starts a new prefix on the least loaded
of its first ``width`` ring candidates (the ring's own pick on ties) and
remembers that choice, so the prefix's later requests find its cache there.
Spill (:mod:`prefix_router.core.spill`) then walks from that home as from any other.

What is remembered, per key, is two 16-bit identity tags: the home's and the
ring pick's at the time. A placement holds while its home is a candidate,
unless an instance that joined took the key's ring position (the ring pick
changed while the old pick is still there): then the key goes to the newcomer,
as under consistent hashing, so new instances take their share. When the home
leaves, the key goes where the ring now sends it. So a resize moves keys only
to the instances that came and only from those that went. (Two of a key's 16
candidates share a tag about once in 500 keys; such a prefix may then start on
the other of the two.)

Memory is a table of ``2**SLOT_BITS`` slots indexed by the top bits of the
key's ring hash, kept in two generations of ``memory_s / 2``: a placement used
within ``memory_s`` is found (and carried into the current generation), one
unused for longer is forgotten. Two keys in one slot sit next to each other on
the ring, so they share their candidates and mostly their placement. Memory is
bounded whatever the traffic. The Redis store keeps the same table as a
bitfield and applies these rules inside its Lua call, so every ext_proc
replica sees one placement; :class:`PlacementMemory` is the in-process table
(one replica, the degraded mode, the discrete-event simulation).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from prefix_router.core.config import PlacementPolicyName, RouterConfig

SLOT_BITS = 20
"""1,048,576 slots: 4 MiB per generation as 32-bit fields in Redis."""


@dataclass(frozen=True, slots=True)
class PlacementRule:
    """The placement settings one decision needs; built once per config."""

    policy: PlacementPolicyName = PlacementPolicyName.HOME
    width: int = 4
    memory_s: float = 600.0

    @classmethod
    def from_config(cls, config: RouterConfig) -> PlacementRule:
        p = config.placement
        return cls(policy=p.policy, width=p.width, memory_s=p.memory_s)

    @property
    def remembers(self) -> bool:
        return self.policy is not PlacementPolicyName.HOME


@dataclass(frozen=True, slots=True)
class Placement:
    """One request's placement inputs: the rule, its key's slot, its candidates' tags."""

    rule: PlacementRule
    slot: int
    tags: Sequence[int]
    """:func:`identity_tag` of each candidate, in ring order."""


def identity_tag(ring_key: str) -> int:
    """A 16-bit, never-zero tag of an instance's ring identity (0 marks an empty slot)."""
    return 1 + xxhash.xxh64_intdigest(ring_key.encode()) % 0xFFFF


def slot_of(ring_hash: int) -> int:
    """The placement slot of a key whose ring hash is ``ring_hash`` (64-bit)."""
    return ring_hash >> (64 - SLOT_BITS)


def place(loads: Sequence[int], rule: PlacementRule) -> int:
    """Index into ``loads`` (ring order) of the candidate a new prefix starts on."""
    if rule.policy is PlacementPolicyName.HOME:
        return 0
    return min(range(min(rule.width, len(loads))), key=loads.__getitem__)


def remembered(value: int, tags: Sequence[int]) -> int | None:
    """The remembered home's index among the candidates, if the placement still holds."""
    home, pick = value >> 16, value & 0xFFFF
    if pick != tags[0] and pick in tags:  # an instance that joined took the key
        return None
    for index, tag in enumerate(tags):
        if tag == home:
            return index
    return None  # the home left


def memory_value(tags: Sequence[int], index: int) -> int:
    """What the slot holds once the prefix's home is candidate ``index``."""
    return tags[index] << 16 | tags[0]


class PlacementMemory:
    """This process's placement table, in two generations; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._current: dict[int, int] = {}
        self._previous: dict[int, int] = {}
        self._generation = 0
        self._half_s = 0.0

    def start(self, placement: Placement | None, loads: Sequence[int]) -> int:
        """The home index of the request's prefix: remembered, or placed now (and remembered)."""
        if placement is None or not placement.rule.remembers:
            return 0
        self._advance(placement.rule.memory_s / 2)
        slot, tags = placement.slot, placement.tags
        value = self._current.get(slot) or self._previous.get(slot)
        if value is None:
            index = place(loads, placement.rule)
        else:  # where the ring sends it, unless the placement holds
            index = remembered(value, tags) or 0
        self._current[slot] = memory_value(tags, index)
        return index

    def __len__(self) -> int:
        return len(self._current.keys() | self._previous.keys())

    def _advance(self, half_s: float) -> None:
        generation = math.floor(self.clock() / half_s)
        if half_s != self._half_s:  # memory_s changed: start afresh
            self._half_s = half_s
            self._current, self._previous = {}, {}
        elif generation == self._generation:
            return
        elif generation == self._generation + 1:
            self._current, self._previous = {}, self._current
        else:
            self._current, self._previous = {}, {}
        self._generation = generation
