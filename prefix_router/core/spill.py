"""Overload spill: the pure decision of which ring candidate takes a request.

Candidates come in ring order from the key's position: index 0 is Envoy's own
pick for the key, then the stable second, third, ... candidates. The prefix's
home is candidate ``start`` (0 unless :mod:`prefix_router.core.placement` started
the prefix elsewhere); the walk goes home first, then the others in ring order.
Each policy is one small rule over the candidates' fleet-wide in-flight counts:

``none``
    Always home; counts are still kept, for metrics.
``bounded-load``
    The first candidate whose count is below ConcurrencyThreshold
    (bounded-load consistent hashing: a hot prefix spills to a stable second and
    third home, whose caches then hold it too); if all are at or above it, the
    least loaded (the first of equals).
``relative-load``
    The same walk with a relative bound: no instance above
    ``ceil(load_factor x (fleet in-flight + 1) / fleet size)``.

The Redis store runs the same rule inside one Lua call so check-and-reserve is
atomic; the table-driven tests hold this module and the Lua to the same cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefix_router.core.config import RouterConfig, SpillPolicyName


@dataclass(frozen=True, slots=True)
class SpillRule:
    """The spill settings one decision needs; built once per config."""

    policy: SpillPolicyName
    threshold: int
    load_factor: float = 1.25

    @classmethod
    def from_config(cls, config: RouterConfig) -> SpillRule:
        return cls(
            policy=config.spill.policy,
            threshold=config.concurrency_threshold,
            load_factor=config.spill.load_factor,
        )

    def limit(self, fleet_total: int, fleet_size: int) -> int:
        """In-flight count at or above which an instance takes no more requests."""
        if self.policy is SpillPolicyName.RELATIVE_LOAD:
            return max(1, math.ceil(self.load_factor * (fleet_total + 1) / max(1, fleet_size)))
        return self.threshold


def walk(size: int, start: int = 0) -> Sequence[int]:
    """Candidate indexes in the order spill tries them: ``start`` (the home), then ring order."""
    if start == 0:
        return range(size)
    return [start, *range(start), *range(start + 1, size)]


def choose(
    loads: Sequence[int],
    rule: SpillRule,
    *,
    fleet_total: int = 0,
    fleet_size: int = 1,
    start: int = 0,
) -> int:
    """Index into ``loads`` (ring order) of the candidate that takes the request;
    ``start`` is the prefix's home."""
    if not loads:
        raise ValueError("choose() needs at least one candidate")
    if not 0 <= start < len(loads):
        raise ValueError(f"start {start} is not a candidate index (0..{len(loads) - 1})")
    if rule.policy is SpillPolicyName.NONE:
        return start
    limit = rule.limit(fleet_total, fleet_size)
    order = walk(len(loads), start)
    for index in order:
        if loads[index] < limit:
            return index
    return min(order, key=loads.__getitem__)
