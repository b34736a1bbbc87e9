"""The contract of a routing store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from prefix_router.core.decision import Decision
from prefix_router.core.key import PrefixKey
from prefix_router.core.table import RoutingTable


class StateUnavailable(Exception):
    """The store could not answer in time; the caller decides on its own state."""


class Routed(NamedTuple):
    """A routed request: the decision and the instance whose in-flight count it holds."""

    decision: Decision
    instance_id: str
    ring_order: tuple[int, ...]
    """The key's first ring instances (what :meth:`RoutingTable.header_for` needs)."""
    prefill_end: float = 0.0
    """When the request's prefill was modelled to end, on the store's clock."""


class RoutingStore(Protocol):
    async def route(self, key: PrefixKey, table: RoutingTable, request_id: str = "") -> Routed:
        """Decide where the request goes (:func:`prefix_router.core.decision.decide` on
        the fleet's state), record it (index, prefill queue) and count it in flight."""
        ...

    def route_at_once(
        self, key: PrefixKey, table: RoutingTable, request_id: str = ""
    ) -> Routed | None:
        """:meth:`route` if the store can decide without waiting (on state it holds),
        else None: then await :meth:`route`."""
        ...

    def release(
        self, instance_id: str, prefill_end: float = 0.0, blocks: Sequence[int] = ()
    ) -> None:
        """Count one request on ``instance_id`` as ended (its :attr:`Routed.prefill_end`
        corrects the instance's modelled queue: :func:`prefix_router.core.work.finished`)
        and record that the instance used ``blocks`` (the request's key's) until now
        (:func:`prefix_router.core.decision.release_writes`).
        Never blocks: stores that talk to a server flush releases in the background."""
        ...

    async def in_flight(self) -> dict[str, int]:
        """Fleet-wide in-flight count per instance (instances with 0 may be absent)."""
        ...

    async def close(self) -> None: ...
