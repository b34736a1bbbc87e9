"""Offline hit-rate bounds on hand-computed cases (16-token blocks)."""

from __future__ import annotations

import pytest

from bench.bounds import BoundsTracker


def blocks(name: str, count: int) -> list[bytes]:
    """Stand-in chained hashes: the same name and index give the same block."""
    return [f"{name}{i}".encode() for i in range(count)]


def test_a_repeat_hits_its_full_blocks_capped_below_the_prompt() -> None:
    t = BoundsTracker(capacity_blocks=100)
    # 33 prompt tokens + 1 output: 2 full blocks are left cached
    t.add(blocks("a", 2), prompt_tokens=33, total_tokens=34)
    t.add(blocks("a", 2), prompt_tokens=33, total_tokens=34)
    # exactly 32 tokens: at most (32 - 1) // 16 = 1 block may hit
    t.add(blocks("b", 2), prompt_tokens=32, total_tokens=40)
    t.add(blocks("b", 2), prompt_tokens=32, total_tokens=40)
    r = t.result()
    assert t.queries == 33 + 33 + 32 + 32
    assert r.infinite == pytest.approx((32 + 16) / 130)
    assert r.fleet_lru == r.infinite


def test_lru_evicts_what_the_infinite_cache_keeps() -> None:
    t = BoundsTracker(capacity_blocks=2)
    t.add(blocks("a", 2), prompt_tokens=33, total_tokens=34)
    t.add(blocks("b", 2), prompt_tokens=33, total_tokens=34)  # evicts both of a's blocks
    t.add(blocks("a", 2), prompt_tokens=33, total_tokens=34)
    assert t.infinite_hits == 32
    assert t.lru_hits == 0


def test_a_requests_tail_is_evicted_before_its_head() -> None:
    t = BoundsTracker(capacity_blocks=3)
    t.add(blocks("a", 3), prompt_tokens=49, total_tokens=50)  # a0 a1 a2
    t.add(blocks("b", 1), prompt_tokens=17, total_tokens=18)  # one more block: evict one of a
    hits = t.add(blocks("a", 3), prompt_tokens=49, total_tokens=50)
    assert t.lru_hits == 32  # a0 and a1 survived: a2 (the tail) went first
    assert t.infinite_hits == 48
    assert hits == (48, 32)  # the request's own: (infinite, fleet_lru)


def test_decoded_blocks_count_for_the_next_turn() -> None:
    t = BoundsTracker(capacity_blocks=10)
    # turn 1: 20 prompt tokens + 30 output = 50 tokens, 49 computed: 3 full blocks cached
    t.add(blocks("c", 3), prompt_tokens=20, total_tokens=50)
    # turn 2 resends all 50 plus 30 more: 80 prompt tokens, blocks c0..c2 then new ones
    t.add(blocks("c", 5), prompt_tokens=80, total_tokens=81)
    assert t.infinite_hits == 48
    assert t.result().infinite == pytest.approx(48 / 100)


def test_tokens_are_hashed_as_the_simulator_does() -> None:
    t = BoundsTracker(capacity_blocks=10)
    shared = list(range(1000, 1016))
    t.add_tokens([*shared, *range(16)], [1], model="m")
    t.add_tokens([*shared, *range(100, 116)], [1], model="m")  # same first block only
    t.add_tokens([*shared, *range(16)], [1], model="other")  # another model shares nothing
    assert t.infinite_hits == 16
    with pytest.raises(ValueError):
        BoundsTracker(capacity_blocks=0)
