"""An exact mirror of Envoy's RING_HASH load balancer (xxHash64 variant).

Envoy (1.40, ``source/extensions/load_balancing_policies/ring_hash``) builds the
ring like this, and so do we:

* hosts are taken in host-set order with weights normalised to sum 1;
* ``scale = min(ceil(min_w * minimum_ring_size) / min_w, maximum_ring_size)``
  where ``min_w`` is the smallest normalised weight;
* walking the hosts with running sums ``target += scale * w`` and
  ``while current < target``, host entry ``i`` hashes ``xxh64(f"{key}_{i}")``,
  ``key`` being ``address:port`` or the endpoint's ``envoy.lb`` ``hash_key``;
* entries are sorted by hash; a request hash ``xxh64(header value, seed 0)``
  picks the first entry whose hash is >= it, wrapping to the first entry.

Sizing for minimal disruption: Envoy splits ``minimum_ring_size`` over the hosts,
so with a fixed size every host's entry count changes when one joins and keys
move between hosts that stayed. :func:`ring_size_for` returns ``K x total
weight``; with that minimum every host gets exactly ``K x weight`` entries, its
entries are the same strings before and after a resize, and only the keys of
the joining or leaving host move (the ideal share).

Complexity: building is O(E log E) for E entries, done once per fleet version,
never per request; a lookup is one xxh64 plus a C bisect, O(log E).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from prefix_router.core.fleet import Instance

ENVOY_MAX_RING_SIZE = 8 * 1024 * 1024
ENVOY_DEFAULT_MIN_RING_SIZE = 1024


def hash_key(value: bytes | str) -> int:
    """Envoy's request hash for a header value: xxh64 with seed 0."""
    return xxhash.xxh64_intdigest(value.encode() if isinstance(value, str) else value)


def ring_size_for(instances: Sequence[Instance], entries_per_weight: int) -> int:
    """``minimum_ring_size`` that gives every instance ``K x weight`` entries."""
    total = sum(i.weight for i in instances)
    return max(1, min(entries_per_weight * total, ENVOY_MAX_RING_SIZE))


@dataclass(frozen=True, slots=True)
class Ring:
    """Envoy's ring for one host set. Immutable; build once per fleet version."""

    hosts: tuple[Instance, ...]
    hashes: tuple[int, ...]
    owners: tuple[int, ...]
    """``owners[j]`` is the index in ``hosts`` of the host owning entry ``j``."""

    @classmethod
    def build(
        cls,
        hosts: Sequence[Instance],
        *,
        minimum_ring_size: int = ENVOY_DEFAULT_MIN_RING_SIZE,
        maximum_ring_size: int = ENVOY_MAX_RING_SIZE,
    ) -> Ring:
        hosts = tuple(hosts)
        if not hosts:
            return cls(hosts=(), hashes=(), owners=())
        total = float(sum(h.weight for h in hosts))
        normalised = [h.weight / total for h in hosts]
        min_w = min(normalised)
        scale = min(math.ceil(min_w * minimum_ring_size) / min_w, float(maximum_ring_size))
        entries: list[tuple[int, int]] = []
        current = 0.0
        target = 0.0
        for index, (host, weight) in enumerate(zip(hosts, normalised, strict=True)):
            prefix = host.ring_key + "_"
            target += scale * weight
            i = 0
            while current < target:
                entries.append((xxhash.xxh64_intdigest(f"{prefix}{i}".encode()), index))
                i += 1
                current += 1
        entries.sort(key=lambda e: e[0])
        return cls(
            hosts=hosts,
            hashes=tuple(e[0] for e in entries),
            owners=tuple(e[1] for e in entries),
        )

    def __len__(self) -> int:
        return len(self.hashes)

    def position(self, key_hash: int) -> int:
        """Index of the entry Envoy picks for ``key_hash``."""
        j = bisect_left(self.hashes, key_hash)
        return 0 if j == len(self.hashes) else j

    def pick(self, header_value: bytes | str) -> Instance | None:
        """The host Envoy picks for this ``x-prefix-key`` value."""
        if not self.hashes:
            return None
        return self.hosts[self.owners[self.position(hash_key(header_value))]]

    def successors(self, key_hash: int) -> Iterator[int]:
        """Distinct host indexes in ring order from the key's position, lazily.

        The first is the home (Envoy's pick); the rest are the stable second,
        third, ... instances a request may spread over when the first are overloaded.
        """
        owners = self.owners
        size = len(owners)
        if not size:
            return
        remaining = len(self.hosts)
        seen = bytearray(remaining)
        j = self.position(key_hash)
        for _ in range(size):
            owner = owners[j]
            if not seen[owner]:
                seen[owner] = 1
                yield owner
                remaining -= 1
                if not remaining:
                    return
            j = j + 1 if j + 1 < size else 0

    def share(self) -> dict[str, float]:
        """Fraction of the 64-bit key space each host owns (for the status page)."""
        if not self.hashes:
            return {}
        space = float(1 << 64)
        owned = [0.0] * len(self.hosts)
        previous = self.hashes[-1] - (1 << 64)
        for h, owner in zip(self.hashes, self.owners, strict=True):
            owned[owner] += (h - previous) / space
            previous = h
        return {host.id: owned[i] for i, host in enumerate(self.hosts)}

    def steering_tokens(self, prefix: str = "~steer-") -> tuple[str, ...]:
        """One header value per host that this ring maps to that host.

        Setting ``x-prefix-key`` to ``tokens[i]`` makes Envoy pick host ``i``:
        how a spill decision is carried out. Expected cost: ~N hashes per host,
        once per ring.
        """
        tokens: list[str | None] = [None] * len(self.hosts)
        missing = len(self.hosts)
        i = 0
        while missing and i < 10_000 * max(1, len(self.hosts)):
            token = f"{prefix}{i}"
            owner = self.owners[self.position(hash_key(token))]
            if tokens[owner] is None:
                tokens[owner] = token
                missing -= 1
            i += 1
        return tuple(t or "" for t in tokens)
