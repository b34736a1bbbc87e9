"""The contract of a load store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefix_router.core.placement import Placement
from prefix_router.core.spill import SpillRule


class LoadsUnavailable(Exception):
    """The store could not answer in time; the caller routes by the ring alone."""


@dataclass(frozen=True, slots=True)
class Reservation:
    index: int
    """Index into the candidates of the instance that took the request."""
    loads: tuple[int, ...]
    """Fleet-wide in-flight counts of the candidates before this reservation."""
    start: int = 0
    """Index of the prefix's home among the candidates (see :mod:`prefix_router.core.placement`);
    ``index != start`` means the request spilled."""


class LoadStore(Protocol):
    async def reserve(
        self,
        candidates: Sequence[str],
        rule: SpillRule,
        fleet_size: int,
        request_id: str = "",
        placement: Placement | None = None,
    ) -> Reservation:
        """Atomically find the prefix's home (the ring's pick without ``placement``;
        otherwise remembered, or placed now), choose a candidate from it by ``rule`` and
        count one request on it."""
        ...

    def release(self, instance_id: str) -> None:
        """Count one request on ``instance_id`` as ended. Never blocks: stores that
        talk to a server flush releases in the background."""
        ...

    async def in_flight(self) -> dict[str, int]:
        """Fleet-wide in-flight count per instance (instances with 0 may be absent)."""
        ...

    async def close(self) -> None: ...
