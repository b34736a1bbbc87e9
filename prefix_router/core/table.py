"""The routing table: everything one decision needs that changes only with the fleet or
the config.

A :class:`RoutingTable` is derived once per (fleet version, config version) and never
mutated: the ring mirror over the routable instances, one steering token and one identity
tag per instance, the key settings and the decision rule. ext_proc swaps the whole table
when either version changes, so a request always sees one consistent version.

:meth:`RoutingTable.ring_order` lists the key's ring pick and its ring successors (where a
prefix nobody holds may start); :meth:`RoutingTable.header_for` turns the chosen instance
into the ``x-prefix-key`` value Envoy hashes: the key itself when the ring picks that
instance for it (so Envoy alone would agree), else the instance's steering token.

Identity tags are 16 bits (:func:`~prefix_router.core.index.identity_tag`); two instances
of a fleet whose tags collide (about 3% of 64-instance fleets) are told apart by rehashing
the later one's ring key, in ring-key order, so the tags of a fleet are distinct and an
instance keeps its tag while the others come and go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

from prefix_router.core.config import PrefixMatch, RouterConfig
from prefix_router.core.decision import Decision, DecisionRule, FleetView, block_bytes, decide
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.index import identity_tag
from prefix_router.core.key import KeySettings, PrefixKey
from prefix_router.core.ring import Ring, hash_key, ring_size_for
from prefix_router.core.work import InstanceModel

OVERFLOW_CANDIDATES = 16
"""Ring successors a request may spread over when every usual candidate is overloaded."""


@dataclass(frozen=True, slots=True)
class RoutingTable:
    fleet_version: int
    config_version: int
    config: RouterConfig
    ring: Ring
    ids: tuple[str, ...]
    tokens: tuple[str, ...]
    tags: tuple[int, ...]
    """Each instance's identity tag in the prefix index, distinct within the fleet."""
    instance_of_tag: dict[int, int]
    key_settings: KeySettings
    rule: DecisionRule
    default_model: InstanceModel
    """What an instance is assumed to be until its metrics are learned."""
    _orders: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)
    """Each ring entry's first ``placement.width`` instances, as asked for (at most one
    list per entry)."""

    @classmethod
    def build(cls, fleet: Fleet, config: RouterConfig, *, config_version: int = 0) -> RoutingTable:
        hosts = fleet.routable
        ring = Ring.build(
            hosts, minimum_ring_size=ring_size_for(hosts, config.ring.entries_per_weight)
        )
        tags = distinct_tags(hosts)
        fixed = config.prefix_match is PrefixMatch.FIXED
        return cls(
            fleet_version=fleet.version,
            config_version=config_version,
            config=config,
            ring=ring,
            ids=tuple(h.id for h in hosts),
            tokens=ring.steering_tokens(),
            tags=tags,
            instance_of_tag={tag: i for i, tag in enumerate(tags)},
            key_settings=KeySettings(
                prefix_length=config.prefix_length,
                mode=config.prefix_mode,
                max_parse_bytes=config.openai_max_parse_bytes,
                block_bytes=0 if fixed else block_bytes(config),
            ),
            rule=DecisionRule.from_config(config),
            default_model=InstanceModel(
                prefill_tokens_per_s=config.instance_defaults.prefill_tokens_per_s,
                kv_cache_tokens=config.instance_defaults.kv_cache_tokens,
            ),
        )

    def ring_order(self, key: str, count: int = 0) -> tuple[int, ...]:
        """The key's first ``count`` (default ``placement.width``) instances in ring order:
        the ring's pick, then its successors. The default count is remembered per ring
        entry (a request's common case costs one hash and one bisect)."""
        key_hash = hash_key(key)
        if count:
            return tuple(islice(self.ring.successors(key_hash), count))
        position = self.ring.position(key_hash) if self.ring.hashes else -1
        order = self._orders.get(position)
        if order is None:
            width = self.rule.placement_width
            order = self._orders[position] = tuple(islice(self.ring.successors(key_hash), width))
        return order

    def decide(self, key: PrefixKey, view: FleetView) -> tuple[Decision, tuple[int, ...]]:
        """:func:`~prefix_router.core.decision.decide` with this table; also returns the
        key's ring order (for :meth:`header_for`)."""
        ring_order = self.ring_order(key.value)
        decision = decide(
            key,
            ring_order,
            view,
            self.rule,
            self.tags,
            self.instance_of_tag,
            lambda: self.ring_order(key.value, OVERFLOW_CANDIDATES),
        )
        return decision, ring_order

    def header_for(self, key: str, ring_order: Sequence[int], chosen: int) -> str:
        """The ``x-prefix-key`` value that makes Envoy pick instance ``chosen``."""
        return key if ring_order and ring_order[0] == chosen else self.tokens[chosen]


def distinct_tags(hosts: tuple[Instance, ...]) -> tuple[int, ...]:
    """Each host's identity tag, rehashed where two collide (see the module doc)."""
    taken: dict[int, str] = {}
    by_key: dict[str, int] = {}
    for host in sorted(hosts, key=lambda h: h.ring_key):
        tag, salt = identity_tag(host.ring_key), 0
        while tag in taken:
            salt += 1
            tag = identity_tag(f"{host.ring_key}#{salt}")
        taken[tag] = host.ring_key
        by_key[host.ring_key] = tag
    return tuple(by_key[h.ring_key] for h in hosts)
