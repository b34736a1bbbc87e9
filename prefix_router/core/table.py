"""The routing table and the decision of one request.

A :class:`RoutingTable` is everything ext_proc needs to route, derived once per
(fleet version, config version) and never mutated: the ring mirror over the
routable instances, one steering token and one placement tag per instance, the
key settings, the placement rule and the spill rule. ext_proc swaps the whole
table when either version changes, so a request always sees one consistent
version.

:func:`lookup` lists the key's ring pick and its ring successors, with what
placement needs to find the prefix's home; :func:`header_for` turns the chosen
candidate into the ``x-prefix-key`` value Envoy hashes: the key itself for the
ring's own pick (so Envoy alone would pick the same instance) or the chosen
instance's steering token.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from itertools import islice

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet
from prefix_router.core.key import KeySettings
from prefix_router.core.placement import Placement, PlacementRule, identity_tag, slot_of
from prefix_router.core.ring import Ring, hash_key, ring_size_for
from prefix_router.core.spill import SpillRule

MAX_CANDIDATES = 16
"""Ring successors considered by spill; the least loaded of these takes it when all are full."""


class Outcome(StrEnum):
    """Why a request went where it went; the label of the decisions metric."""

    HOME = "home"
    SPILLED = "spilled"
    RING_ONLY = "ring_only"
    """Fleet-wide loads unavailable (Redis slow or down): the ring and this replica's counts."""
    NO_INSTANCES = "no_instances"


@dataclass(frozen=True, slots=True)
class RoutingTable:
    fleet_version: int
    config_version: int
    config: RouterConfig
    ring: Ring
    ids: tuple[str, ...]
    tokens: tuple[str, ...]
    tags: tuple[int, ...]
    """Each host's placement identity tag (:func:`~prefix_router.core.placement.identity_tag`)."""
    key_settings: KeySettings
    spill: SpillRule
    placement: PlacementRule

    @classmethod
    def build(cls, fleet: Fleet, config: RouterConfig, *, config_version: int = 0) -> RoutingTable:
        hosts = fleet.routable
        ring = Ring.build(
            hosts, minimum_ring_size=ring_size_for(hosts, config.ring.entries_per_weight)
        )
        return cls(
            fleet_version=fleet.version,
            config_version=config_version,
            config=config,
            ring=ring,
            ids=tuple(h.id for h in hosts),
            tokens=ring.steering_tokens(),
            tags=tuple(identity_tag(h.ring_key) for h in hosts),
            key_settings=KeySettings(
                prefix_length=config.prefix_length,
                mode=config.prefix_mode,
                max_parse_bytes=config.openai_max_parse_bytes,
            ),
            spill=SpillRule.from_config(config),
            placement=PlacementRule.from_config(config),
        )

    def lookup(self, key: str) -> tuple[list[int], Placement | None]:
        """Host indexes (the ring's pick for the key, then its ring successors) and what
        placement needs to find the prefix's home among them (None: the ring's pick)."""
        ring_hash = hash_key(key)
        limit = min(len(self.ids), MAX_CANDIDATES)
        candidates = list(islice(self.ring.successors(ring_hash), limit))
        if not self.placement.remembers:
            return candidates, None
        tags = [self.tags[c] for c in candidates]
        return candidates, Placement(self.placement, slot_of(ring_hash), tags)

    def header_for(self, key: str, candidates: list[int], chosen: int) -> str:
        """The ``x-prefix-key`` value that makes Envoy pick ``candidates[chosen]``."""
        return key if chosen == 0 else self.tokens[candidates[chosen]]


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    instance_id: str | None
    header_value: str | None
    home_id: str | None
    """The prefix's home: the ring's pick, or where placement started the prefix."""
