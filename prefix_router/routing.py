"""The routing table and the decision of one request.

A :class:`RoutingTable` is everything ext_proc needs to route, derived once per
(fleet version, config version) and never mutated: the ring mirror over the
routable instances, one steering token per instance, the key settings and the
spill rule. ext_proc swaps the whole table when either changes, so a request
always sees one consistent version.

:func:`candidates_for` lists the key's home and its ring successors;
:func:`decision_for` turns the chosen candidate into the ``x-prefix-key``
value Envoy hashes: the key itself when the request goes home (so Envoy alone
would pick the same instance) or the chosen instance's steering token.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from itertools import islice

from prefix_router.config import RouterConfig
from prefix_router.fleet import Fleet
from prefix_router.prefix_key import KeySettings
from prefix_router.ring import Ring, hash_key, ring_size_for
from prefix_router.spill import SpillRule

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
    key_settings: KeySettings
    spill: SpillRule

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
            key_settings=KeySettings(prefix_length=config.prefix_length, mode=config.prefix_mode),
            spill=SpillRule.from_config(config),
        )

    def candidates_for(self, key: str) -> list[int]:
        """Host indexes: the key's home first, then its ring successors."""
        limit = min(len(self.ids), MAX_CANDIDATES)
        return list(islice(self.ring.successors(hash_key(key)), limit))

    def header_for(self, key: str, candidates: list[int], chosen: int) -> str:
        """The ``x-prefix-key`` value that makes Envoy pick ``candidates[chosen]``."""
        return key if chosen == 0 else self.tokens[candidates[chosen]]


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    instance_id: str | None
    header_value: str | None
    home_id: str | None
