"""The contract of a load store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefix_router.spill import SpillRule


class LoadsUnavailable(Exception):
    """The store could not answer in time; the caller routes by the ring alone."""


@dataclass(frozen=True, slots=True)
class Reservation:
    index: int
    """Index into the candidates of the instance that took the request."""
    loads: tuple[int, ...]
    """Fleet-wide in-flight counts of the candidates before this reservation."""


class LoadStore(Protocol):
    async def reserve(
        self,
        candidates: Sequence[str],
        rule: SpillRule,
        fleet_size: int,
        request_id: str = "",
    ) -> Reservation:
        """Atomically choose a candidate by ``rule`` and count one request on it."""
        ...

    def release(self, instance_id: str) -> None:
        """Count one request on ``instance_id`` as ended. Never blocks: stores that
        talk to a server flush releases in the background."""
        ...

    async def in_flight(self) -> dict[str, int]:
        """Fleet-wide in-flight count per instance (instances with 0 may be absent)."""
        ...

    async def close(self) -> None: ...
