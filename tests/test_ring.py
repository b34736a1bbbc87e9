"""Envoy ring mirror: construction rules, minimal disruption on resize, steering tokens."""

from __future__ import annotations

import random

import pytest

from prefix_router.core.fleet import Instance
from prefix_router.core.ring import Ring, hash_key, ring_size_for

K = 256


def hosts(n: int, start: int = 8000) -> list[Instance]:
    return [Instance("10.0.0.1", start + i) for i in range(n)]


def ring_of(members: list[Instance]) -> Ring:
    return Ring.build(members, minimum_ring_size=ring_size_for(members, K))


def test_each_host_gets_k_times_weight_entries() -> None:
    members = [Instance("10.0.0.1", 1, weight=1), Instance("10.0.0.2", 2, weight=3)]
    ring = ring_of(members)
    counts = [ring.owners.count(i) for i in range(2)]
    assert counts == [K, 3 * K]


def test_envoy_default_sizing_splits_the_minimum_ring_over_hosts() -> None:
    ring = Ring.build(hosts(3), minimum_ring_size=1024)
    assert [ring.owners.count(i) for i in range(3)] == [342, 342, 342]


def test_lookup_picks_the_first_entry_at_or_after_the_hash_and_wraps() -> None:
    ring = ring_of(hosts(3))
    assert ring.position(ring.hashes[5]) == 5
    assert ring.position(ring.hashes[5] + 1) == 6
    assert ring.position(ring.hashes[-1] + 1) == 0
    assert ring.position(0) == 0


def test_entries_hash_address_port_or_the_hash_key() -> None:
    plain = Instance("10.0.0.1", 80)
    keyed = Instance("10.0.0.1", 80, hash_key="gpu-a")
    assert hash_key("10.0.0.1:80_0") in Ring.build([plain], minimum_ring_size=4).hashes
    assert hash_key("gpu-a_0") in Ring.build([keyed], minimum_ring_size=4).hashes


def moved_fraction(before: Ring, after: Ring, keys: list[str]) -> tuple[float, set[str], set[str]]:
    moved = 0
    moved_from: set[str] = set()
    moved_to: set[str] = set()
    for k in keys:
        a, b = before.pick(k), after.pick(k)
        assert a is not None and b is not None
        if a.id != b.id:
            moved += 1
            moved_from.add(a.id)
            moved_to.add(b.id)
    return moved / len(keys), moved_from, moved_to


KEYS = [f"key-{random.Random(1).random()}-{i}" for i in range(8000)]


@pytest.mark.parametrize("n", range(3, 33))
def test_adding_a_host_moves_only_its_share(n: int) -> None:
    members = hosts(n)
    newcomer = Instance("10.0.0.2", 9999)
    fraction, _, moved_to = moved_fraction(ring_of(members), ring_of([*members, newcomer]), KEYS)
    assert moved_to <= {newcomer.id}
    assert fraction <= 1.15 * (1 / (n + 1)) + 0.01


@pytest.mark.parametrize("n", range(3, 33))
def test_removing_a_host_moves_only_its_keys(n: int) -> None:
    members = hosts(n)
    leaver = members[n // 2]
    rest = [m for m in members if m != leaver]
    fraction, moved_from, _ = moved_fraction(ring_of(members), ring_of(rest), KEYS)
    assert moved_from <= {leaver.id}
    assert fraction <= 1.15 * (1 / n) + 0.01


def test_steering_tokens_make_envoy_pick_each_host() -> None:
    ring = ring_of(hosts(7))
    tokens = ring.steering_tokens()
    for index, token in enumerate(tokens):
        assert ring.pick(token) == ring.hosts[index]


def test_successors_list_distinct_hosts_in_ring_order_from_home() -> None:
    ring = ring_of(hosts(5))
    order = list(ring.successors(hash_key("some key")))
    assert sorted(order) == list(range(5))
    assert ring.hosts[order[0]] == ring.pick("some key")


def test_key_space_shares_sum_to_one_and_follow_weights() -> None:
    members = [Instance("10.0.0.1", 1, weight=1), Instance("10.0.0.2", 2, weight=3)]
    share = ring_of(members).share()
    assert sum(share.values()) == pytest.approx(1.0)
    assert share["10.0.0.2:2"] == pytest.approx(0.75, abs=0.08)


def test_an_empty_ring_picks_nothing() -> None:
    ring = Ring.build([])
    assert ring.pick("k") is None
    assert list(ring.successors(1)) == []
