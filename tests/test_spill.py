"""The spill rule, table-driven: which ring candidate takes the request."""

from __future__ import annotations

import pytest

from prefix_router.core.config import SpillPolicyName
from prefix_router.core.spill import SpillRule, choose

BOUNDED = SpillRule(SpillPolicyName.BOUNDED_LOAD, threshold=4)
RELATIVE = SpillRule(SpillPolicyName.RELATIVE_LOAD, threshold=4, load_factor=1.5)
NONE = SpillRule(SpillPolicyName.NONE, threshold=4)

# (rule, candidate loads in ring order, fleet total, fleet size, expected index)
CASES = [
    (BOUNDED, [0, 0, 0], 0, 3, 0),
    (BOUNDED, [3, 0, 0], 3, 3, 0),  # below the threshold: home
    (BOUNDED, [4, 0, 0], 4, 3, 1),  # at it: the next distinct instance
    (BOUNDED, [4, 9, 2], 15, 3, 2),  # walk on past a full second home
    (BOUNDED, [5, 4, 6], 15, 3, 1),  # all full: the least loaded
    (BOUNDED, [5, 4, 4], 13, 3, 1),  # all full, ties: the first of equals
    (NONE, [100, 0, 0], 100, 3, 0),  # spill disabled: always home
    (RELATIVE, [2, 0, 0], 2, 3, 1),  # limit ceil(1.5 * 3 / 3) = 2: home is full
    (RELATIVE, [1, 0, 0], 1, 3, 1),  # limit ceil(1.5 * 2 / 3) = 1: 1 is not below 1
    (RELATIVE, [3, 3, 0], 6, 3, 0),  # limit ceil(1.5 * 7 / 3) = 4
    (RELATIVE, [4, 3, 0], 7, 3, 1),  # limit ceil(1.5 * 8 / 3) = 4
]


@pytest.mark.parametrize(("rule", "loads", "total", "size", "expected"), CASES)
def test_choose(rule: SpillRule, loads: list[int], total: int, size: int, expected: int) -> None:
    assert choose(loads, rule, fleet_total=total, fleet_size=size) == expected


def test_relative_limit_follows_the_fleet_mean() -> None:
    assert RELATIVE.limit(0, 4) == 1
    assert RELATIVE.limit(39, 4) == 15  # ceil(1.5 * 40 / 4)
    assert BOUNDED.limit(1000, 4) == 4


def test_choose_needs_a_candidate() -> None:
    with pytest.raises(ValueError):
        choose([], BOUNDED)
