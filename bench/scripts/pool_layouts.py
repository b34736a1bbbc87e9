"""Two ways to make Envoy route within a pool, compared on what decides between them.

    python bench/scripts/pool_layouts.py [--instances 16] [--keys 20000]

* **A cluster per pool** (what prefix-router does): each pool's cluster has its own ring,
  sized ``K x the pool's weight``, so every host of the pool has exactly ``K x weight``
  entries whatever the rest of the fleet does.
* **Subset load balancing** (one cluster, ``lb_subset_config`` by model): Envoy builds a
  ring per subset with the *cluster's* ``minimum_ring_size``; the only size that one
  cluster can carry is ``K x the whole fleet's weight``.

The ring is Envoy's RING_HASH as ``prefix_router.core.ring`` mirrors it (checked against a
live Envoy by tests/test_ring_matches_envoy.py). For each layout it prints the keys of a
pool that moved between two of *its own* instances when an instance joined *another* pool
(consistent hashing's promise is 0: a resize moves only the keys of the instance that
came or went), and the size of the xDS resources (CDS + EDS, serialized) for fleets with
more and more pools.
"""

from __future__ import annotations

import argparse

from control_plane.snapshot import build_snapshot
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.ring import Ring, ring_size_for


def fleet_of(instances: int, models: int, adapters_per_model: int) -> Fleet:
    """``instances`` spread over ``models`` base models; each model's adapters are loaded
    on the first half of its instances."""
    out = []
    for n in range(instances):
        base = n % models
        served = [f"base-{base}"]
        if n // models < max(1, instances // models // 2):
            served += [f"base-{base}-lora-{a}" for a in range(adapters_per_model)]
        out.append(Instance("10.0.0.1", 8000 + n, models=tuple(served)))
    return Fleet.of(out)


def moved_within(before: Ring, after: Ring, keys: list[str]) -> int:
    return sum(
        (a := before.pick(k)) is not None and (b := after.pick(k)) is not None and a.id != b.id
        for k in keys
    )


def resize_disruption(instances: int, keys: int) -> None:
    k = RouterConfig().ring.entries_per_weight
    pool_a = [Instance("10.0.0.1", 8000 + n) for n in range(instances // 2)]
    pool_b = [Instance("10.0.0.2", 8000 + n) for n in range(instances // 2)]
    joined = Instance("10.0.0.2", 9000)
    sample = [f"key-{n}" for n in range(keys)]
    whole_before = ring_size_for(pool_a + pool_b, k)
    whole_after = ring_size_for([*pool_a, *pool_b, joined], k)
    per_pool = Ring.build(pool_a, minimum_ring_size=ring_size_for(pool_a, k))
    subset_before = Ring.build(pool_a, minimum_ring_size=whole_before)
    subset_after = Ring.build(pool_a, minimum_ring_size=whole_after)
    print(f"one instance joins pool B ({instances // 2} instances in each pool, {keys} keys of A)")
    print(f"  cluster per pool: keys of A moved {moved_within(per_pool, per_pool, sample)}")
    moved = moved_within(subset_before, subset_after, sample)
    print(f"  subset LB:        keys of A moved {moved} ({100 * moved / keys:.1f}%)")


def config_sizes(instances: int) -> None:
    config = RouterConfig()
    print(f"xDS resources for {instances} instances (CDS + EDS bytes, clusters)")
    for models, adapters in ((1, 0), (2, 0), (2, 2), (4, 4), (4, 16)):
        fleet = fleet_of(instances, models, adapters)
        snapshot = build_snapshot(fleet, config, config_version=1)
        size = sum(a.ByteSize() for by in snapshot.resources.values() for a in by.values())
        clusters = len(snapshot.resources[next(iter(snapshot.resources))])
        pools = models * (1 + adapters)
        print(
            f"  {pools:3d} pools ({models} models x {adapters} adapters): "
            f"{size:7d} bytes, {clusters} clusters"
        )
    plain = Fleet.of([Instance("10.0.0.1", 8000 + n) for n in range(instances)])
    size = sum(
        a.ByteSize()
        for by in build_snapshot(plain, config, config_version=1).resources.values()
        for a in by.values()
    )
    print(f"  no declared model: {size} bytes, 1 cluster")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--keys", type=int, default=20_000)
    args = p.parse_args()
    resize_disruption(args.instances, args.keys)
    config_sizes(args.instances)


if __name__ == "__main__":
    main()
