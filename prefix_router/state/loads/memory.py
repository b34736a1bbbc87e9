"""In-process load store: exact counts and placements for a single ext_proc replica."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from prefix_router.core.placement import Placement, PlacementMemory
from prefix_router.core.spill import SpillRule, choose
from prefix_router.state.loads.base import Reservation


class InMemoryLoadStore:
    """Counts live in this process only: correct for one replica, not shared."""

    def __init__(self, placements: PlacementMemory | None = None) -> None:
        self._counts: defaultdict[str, int] = defaultdict(int)
        self._total = 0
        self.placements = placements or PlacementMemory()

    async def reserve(
        self,
        candidates: Sequence[str],
        rule: SpillRule,
        fleet_size: int,
        request_id: str = "",
        placement: Placement | None = None,
    ) -> Reservation:
        loads = tuple(self._counts[c] for c in candidates)
        start = self.placements.start(placement, loads)
        index = choose(loads, rule, fleet_total=self._total, fleet_size=fleet_size, start=start)
        self._counts[candidates[index]] += 1
        self._total += 1
        return Reservation(index=index, loads=loads, start=start)

    def release(self, instance_id: str) -> None:
        if self._counts.get(instance_id, 0) > 0:
            self._counts[instance_id] -= 1
            self._total -= 1

    async def in_flight(self) -> dict[str, int]:
        return {k: v for k, v in self._counts.items() if v}

    async def close(self) -> None:
        self._counts.clear()
        self._total = 0
