"""Placement of new prefixes: the pure rule and the in-process memory (table-driven)."""

from __future__ import annotations

import pytest

from prefix_router.core.config import PlacementPolicyName, RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.placement import (
    SLOT_BITS,
    Placement,
    PlacementMemory,
    PlacementRule,
    identity_tag,
    memory_value,
    place,
    remembered,
    slot_of,
)
from prefix_router.core.table import RoutingTable

LEAST = PlacementRule(PlacementPolicyName.LEAST_LOADED, width=3, memory_s=10.0)
HOME = PlacementRule(PlacementPolicyName.HOME)
TAGS = [11, 22, 33, 44]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("loads", "rule", "expected"),
    [
        ([3, 1, 2, 0], LEAST, 1),  # the least loaded within the width (index 3 is past it)
        ([1, 1, 1, 0], LEAST, 0),  # ties: the ring's pick
        ([2, 1, 1], LEAST, 1),  # ties further on: the first in ring order
        ([5], LEAST, 0),
        ([3, 1, 2, 0], HOME, 0),
    ],
)
def test_place(loads: list[int], rule: PlacementRule, expected: int) -> None:
    assert place(loads, rule) == expected


def test_a_placement_holds_while_the_ring_pick_stays_and_the_home_is_a_candidate() -> None:
    value = memory_value(TAGS, 2)
    assert remembered(value, TAGS) == 2
    assert remembered(value, [11, 99, 33, 22]) == 2  # one joined elsewhere on the ring
    assert remembered(value, [99, 11, 22, 33]) is None  # one that joined took the key
    assert remembered(value, [22, 33, 44]) == 1  # the ring pick (11) left: the home holds
    assert remembered(value, [11, 22, 44]) is None  # the home left


def test_memory_remembers_a_placement_and_forgets_it_after_memory_s_unused() -> None:
    clock = Clock()
    memory = PlacementMemory(clock)
    placement = Placement(LEAST, slot=7, tags=TAGS)
    assert memory.start(placement, [3, 1, 2, 0]) == 1
    assert memory.start(placement, [0, 9, 0, 0]) == 1  # remembered, whatever the loads now
    clock.now += 9.9  # still used within memory_s: carried into each new generation
    assert memory.start(placement, [0, 9, 0, 0]) == 1
    clock.now += 10.1  # unused for longer than memory_s
    assert memory.start(placement, [0, 9, 0, 0]) == 0
    assert len(memory) == 1


def test_a_key_the_ring_gives_away_goes_where_the_ring_sends_it() -> None:
    memory = PlacementMemory(Clock())
    assert memory.start(Placement(LEAST, 7, TAGS), [3, 1, 2]) == 1
    moved = Placement(LEAST, 7, [55, *TAGS])  # a new instance took the key's ring position
    assert memory.start(moved, [5, 0, 1, 2]) == 0  # not the least loaded: the ring's pick
    assert memory.start(moved, [5, 0, 1, 2]) == 0  # and remembered there
    assert memory.start(Placement(LEAST, 8, TAGS), [3, 1, 2]) == 1  # 22
    assert memory.start(Placement(LEAST, 8, [33, 44]), [3, 0]) == 0  # 22 left: the ring's pick
    assert memory.start(Placement(LEAST, 9, TAGS), [3, 1, 2]) == 1  # 22
    pick_left = Placement(LEAST, 9, [33, 22])  # the ring's pick (11) left
    assert memory.start(pick_left, [0, 4]) == 1  # 22, still its home


def test_home_policy_and_no_placement_start_on_the_ring_pick_and_remember_nothing() -> None:
    memory = PlacementMemory(Clock())
    assert memory.start(Placement(HOME, 7, TAGS), [3, 1, 2]) == 0
    assert memory.start(None, [3, 1, 2]) == 0
    assert len(memory) == 0


def test_a_new_memory_s_starts_afresh() -> None:
    memory = PlacementMemory(Clock())
    assert memory.start(Placement(LEAST, 7, TAGS), [3, 1, 2]) == 1
    longer = PlacementRule(PlacementPolicyName.LEAST_LOADED, width=3, memory_s=20.0)
    assert memory.start(Placement(longer, 7, TAGS), [0, 1, 2]) == 0


def test_slots_and_tags_fit_their_redis_fields() -> None:
    assert slot_of(2**64 - 1) == 2**SLOT_BITS - 1 and slot_of(0) == 0
    tags = {identity_tag(f"10.0.0.{i}:8000") for i in range(1000)}
    assert all(1 <= t <= 0xFFFF for t in tags) and len(tags) > 980  # ~8 birthday collisions


def test_the_routing_table_carries_the_placement_a_lookup_needs() -> None:
    fleet = Fleet.of([Instance("10.0.0.1", 8000 + i) for i in range(5)])
    table = RoutingTable.build(fleet, RouterConfig())
    candidates, placement = table.lookup("some-key")
    assert placement is not None and placement.rule == PlacementRule.from_config(RouterConfig())
    assert list(placement.tags) == [identity_tag(fleet.routable[c].ring_key) for c in candidates]
    ring_only = RouterConfig.model_validate({"placement": {"policy": "home"}})
    assert RoutingTable.build(fleet, ring_only).lookup("some-key") == (candidates, None)
