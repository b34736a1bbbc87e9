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

Pools (:mod:`.pools`): when the fleet declares models, the table also holds one
:class:`Pool` per model (and the catch-all), each with the ring Envoy's cluster for that
pool runs, its steering tokens and its identity tags. :meth:`RoutingTable.decide` decides
within the pool of the key's model; instance indexes stay the table's, so the stores, the
loads and the prefix index are the same whatever the pool. A fleet that declares no model
has one pool, the whole fleet, and decides exactly as before.

Identity tags are 16 bits (:func:`~prefix_router.core.index.identity_tag`); two instances
of a fleet whose tags collide (about 3% of 64-instance fleets) are told apart by rehashing
the later one's ring key, in ring-key order over the whole fleet, routable or not, so
the tags of a fleet are distinct and an instance keeps its tag while the others go
unhealthy, drain and come back (one removed from the fleet may pass its tag on to the one
it collided with).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice

from prefix_router.core.config import PrefixMatch, RouterConfig
from prefix_router.core.decision import Decision, DecisionRule, FleetView, block_bytes, decide
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.index import identity_tag
from prefix_router.core.key import KeySettings, PrefixKey
from prefix_router.core.pools import CATCH_ALL, cluster_name, layout, models_list_body
from prefix_router.core.ring import Ring, hash_key, ring_size_for
from prefix_router.core.work import InstanceModel

OVERFLOW_CANDIDATES = 16
"""Ring successors a request may spread over when every usual candidate is overloaded."""


@dataclass(frozen=True, slots=True)
class Pool:
    """The instances one request may go to (:mod:`.pools`) and the ring Envoy's cluster
    for them runs: the same ring code as the whole fleet's, over the pool's instances.

    Indexes are the table's (into :attr:`RoutingTable.ids`), so loads, tags and the
    decision's writes are the same whatever the pool."""

    name: str
    """The model (or :data:`~.pools.CATCH_ALL`); empty for the whole fleet."""
    header: str | None
    """The ``x-prefix-pool`` value (its Envoy cluster); None: the whole-fleet cluster,
    Envoy's default route."""
    members: tuple[int, ...]
    """Its routable instances, in ring (host-set) order."""
    ring: Ring
    tokens: Mapping[int, str]
    """Instance -> a steering token this pool's ring maps to it."""
    instance_of_tag: Mapping[int, int]
    """Identity tag -> instance, for the pool's instances only."""
    whole: bool
    """The whole fleet (the in-flight bound is then the fleet's mean, as without pools)."""
    width: int
    _orders: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)
    """Each ring entry's first ``width`` instances, as asked for."""

    @classmethod
    def build(
        cls,
        name: str,
        header: str | None,
        hosts: Sequence[Instance],
        members: Sequence[int],
        tags: Sequence[int],
        *,
        entries_per_weight: int,
        width: int,
        whole: bool = False,
    ) -> Pool:
        chosen = [hosts[i] for i in members]
        ring = Ring.build(chosen, minimum_ring_size=ring_size_for(chosen, entries_per_weight))
        return cls(
            name=name,
            header=header,
            members=tuple(members),
            ring=ring,
            tokens=dict(zip(members, ring.steering_tokens(), strict=True)),
            instance_of_tag={tags[i]: i for i in members},
            whole=whole,
            width=width,
        )

    def ring_order(self, key: str, count: int = 0) -> tuple[int, ...]:
        """The key's first ``count`` (default ``width``) instances in this pool's ring
        order: the ring's pick, then its successors. The default count is remembered per
        ring entry (a request's common case costs one hash and one bisect)."""
        key_hash = hash_key(key)
        members = self.members
        if count:
            return tuple(members[j] for j in islice(self.ring.successors(key_hash), count))
        position = self.ring.position(key_hash) if self.ring.hashes else -1
        order = self._orders.get(position)
        if order is None:
            order = self._orders[position] = tuple(
                members[j] for j in islice(self.ring.successors(key_hash), self.width)
            )
        return order


@dataclass(frozen=True, slots=True)
class RoutingTable:
    fleet_version: int
    config_version: int
    config: RouterConfig
    ring: Ring
    """The whole fleet's ring (Envoy's ``models`` cluster)."""
    ids: tuple[str, ...]
    tokens: tuple[str, ...]
    tags: tuple[int, ...]
    """Each instance's identity tag in the prefix index, distinct within the fleet."""
    instance_of_tag: dict[int, int]
    index_of: dict[str, int]
    """Instance id -> its index into :attr:`ids`."""
    key_settings: KeySettings
    rule: DecisionRule
    default_model: InstanceModel
    """What an instance is assumed to be until its metrics are learned."""
    whole: Pool
    """Every routable instance: the one pool of a fleet that declares no model."""
    pools: Mapping[str, Pool] = field(default_factory=dict)
    """Model -> its pool; empty when the fleet declares no model (:mod:`.pools`)."""
    catch_all: Pool | None = None
    """Where a model no instance names goes (instances that declare nothing), or None:
    such a model is unknown."""
    models_body: bytes = b""
    """``GET /v1/models`` for the fleet (:func:`~.pools.models_list_body`), when pooled."""

    @classmethod
    def build(cls, fleet: Fleet, config: RouterConfig, *, config_version: int = 0) -> RoutingTable:
        hosts = fleet.routable
        tags = distinct_tags(hosts, among=fleet.instances)
        fixed = config.prefix_match is PrefixMatch.FIXED
        k, width = config.ring.entries_per_weight, config.placement.width
        whole = Pool.build(
            "", None, hosts, range(len(hosts)), tags, entries_per_weight=k, width=width, whole=True
        )
        lay = layout(fleet.instances)
        index = {h.id: i for i, h in enumerate(hosts)}

        built: dict[tuple[int, ...], Pool] = {}

        def pool(name: str, instances: Sequence[Instance]) -> Pool:
            members = tuple(index[i.id] for i in instances if i.id in index)
            same = built.get(members)  # pools of the same instances share one ring
            if same is not None:
                return replace(same, name=name, header=cluster_name(name))
            built[members] = Pool.build(
                name, cluster_name(name), hosts, members, tags, entries_per_weight=k, width=width
            )
            return built[members]

        pools = {name: pool(name, insts) for name, insts in lay.by_model.items()}
        catch_all = pool(CATCH_ALL, lay.catch_all) if lay.pooled and lay.catch_all else None
        return cls(
            fleet_version=fleet.version,
            config_version=config_version,
            config=config,
            ring=whole.ring,
            ids=tuple(h.id for h in hosts),
            tokens=tuple(whole.tokens[i] for i in range(len(hosts))),
            tags=tags,
            instance_of_tag=dict(whole.instance_of_tag),
            index_of=index,
            key_settings=KeySettings(
                prefix_length=config.prefix_length,
                mode=config.prefix_mode,
                max_parse_bytes=config.openai_max_parse_bytes,
                block_bytes=0 if fixed else block_bytes(config),
                by_model=lay.pooled,
            ),
            rule=DecisionRule.from_config(config),
            default_model=InstanceModel(
                prefill_tokens_per_s=config.instance_defaults.prefill_tokens_per_s,
                kv_cache_tokens=config.instance_defaults.kv_cache_tokens,
            ),
            whole=whole,
            pools=pools,
            catch_all=catch_all,
            models_body=models_list_body(fleet.instances) if lay.pooled else b"",
        )

    @property
    def pooled(self) -> bool:
        """True when the fleet routes by model (some instance says what it serves)."""
        return bool(self.pools)

    def pool_for(self, model: str | None) -> Pool | None:
        """The pool of a request naming ``model``: the whole fleet when the fleet is not
        pooled or the request names no model (an empty name too: vLLM serves its default
        model for it); None when no instance serves ``model``."""
        if not self.pools or model is None or not model.strip():
            return self.whole
        return self.pools.get(model) or self.catch_all

    def ring_order(self, key: str, count: int = 0, pool: Pool | None = None) -> tuple[int, ...]:
        """The key's first ``count`` (default ``placement.width``) instances in the ring
        order of ``pool`` (default: the whole fleet)."""
        return (pool or self.whole).ring_order(key, count)

    def decide(self, key: PrefixKey, view: FleetView) -> tuple[Decision, tuple[int, ...]]:
        """:func:`~prefix_router.core.decision.decide` within the key's pool (the whole
        fleet for a model no pool serves: the caller answers those before deciding); also
        returns the key's ring order in that pool (for :meth:`header_for`)."""
        pool = self.pool_for(key.model) or self.whole
        ring_order = pool.ring_order(key.value)
        decision = decide(
            key,
            ring_order,
            view,
            self.rule,
            self.tags,
            pool.instance_of_tag,
            lambda: pool.ring_order(key.value, OVERFLOW_CANDIDATES),
            None if pool.whole else pool.members,
        )
        return decision, ring_order

    def header_for(
        self, key: str, ring_order: Sequence[int], chosen: int, pool: Pool | None = None
    ) -> str:
        """The ``x-prefix-key`` value that makes Envoy's ring of ``pool`` (default: the
        whole fleet) pick instance ``chosen``."""
        if ring_order and ring_order[0] == chosen:
            return key
        return (pool or self.whole).tokens[chosen]


def distinct_tags(hosts: tuple[Instance, ...], among: Sequence[Instance] = ()) -> tuple[int, ...]:
    """Each host's identity tag, rehashed where two collide (see the module doc).

    Collisions are settled over ``among`` (the whole fleet: the hosts and those not
    routable now), so a host's tag does not change when another one only goes unhealthy
    or drains: the prefix index's entries of each would pass to the other."""
    taken: dict[int, str] = {}
    by_key: dict[str, int] = {}
    for host in sorted(
        {h.ring_key: h for h in (*among, *hosts)}.values(), key=lambda h: h.ring_key
    ):
        tag, salt = identity_tag(host.ring_key), 0
        while tag in taken:
            salt += 1
            tag = identity_tag(f"{host.ring_key}#{salt}")
        taken[tag] = host.ring_key
        by_key[host.ring_key] = tag
    return tuple(by_key[h.ring_key] for h in hosts)
