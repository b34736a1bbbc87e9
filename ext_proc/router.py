"""The request router: key -> candidates -> reservation -> decision, for one request.

This is the part of ext_proc that knows nothing about gRPC. It holds the
current :class:`~prefix_router.core.table.RoutingTable` (swapped whole when the
fleet or the config changes) and a :class:`~prefix_router.state.loads.LoadStore`.

The store bounds its own waits on Redis (``redis_timeout_ms`` per round trip)
and reports a failed or slow Redis as :class:`LoadsUnavailable`: the request is
then routed without fleet-wide counts (``RING_ONLY``): placed and spilled on
this replica's own counts and placements, so a hot prefix is still spread, if
less evenly. The failure is logged once, and the store is left alone for a short
back-off so a dead Redis costs each request nothing; the first success after
that logs the recovery. Time a
request spends queued in this process under a burst is not Redis being slow,
so it does not count against Redis; a backstop of ``STORE_WAIT_FACTOR`` round
trips still bounds the wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prefix_router.core.key import Fallback, PrefixKey, extract_key
from prefix_router.core.placement import Placement
from prefix_router.core.table import Decision, Outcome, RoutingTable
from prefix_router.state.loads import InMemoryLoadStore, LoadStore, LoadsUnavailable, Reservation

log = logging.getLogger("prefix_router.ext_proc")

STORE_BACKOFF_S = 0.5
STORE_WAIT_FACTOR = 10


class RouterCallbacks:
    """Hooks for metrics and logs; every method is a no-op by default."""

    def on_decision(self, decision: Decision, seconds: float, request_id: str) -> None:
        """A request was routed; ``seconds`` is the decision's latency."""

    def on_fallback(self, reason: Fallback) -> None:
        """``openai`` key extraction fell back to ``bytes``."""

    def on_reserved(self, instance_id: str) -> None:
        """A request now counts as in flight on ``instance_id``."""

    def on_finished(self, instance_id: str) -> None:
        """A request counted on ``instance_id`` ended."""

    def on_error(self, error: BaseException) -> None:
        """Routing failed with an unexpected error; the request went on unrouted."""

    def on_stream_end(self, reset: bool) -> None:
        """An ext_proc stream ended: closed by Envoy's half-close, or ``reset``."""


@dataclass(slots=True)
class RouteResult:
    decision: Decision
    key: PrefixKey
    reserved: str | None
    """Instance id whose in-flight count this request holds, to release at its end."""
    store: LoadStore | None = None
    """The store holding that count."""


class RequestRouter:
    def __init__(
        self,
        table: RoutingTable,
        store: LoadStore,
        callbacks: RouterCallbacks | None = None,
    ) -> None:
        self.table = table
        self.store = store
        self.callbacks = callbacks or RouterCallbacks()
        self.local = InMemoryLoadStore()
        """Counts of the requests routed while the shared store was unavailable."""
        self._store_down_until = 0.0
        self._store_down = False

    def use(self, table: RoutingTable) -> None:
        """Route new requests with ``table``; requests in flight keep theirs."""
        self.table = table

    async def route(
        self,
        body: bytes,
        *,
        path: str,
        tenant: str,
        complete: bool = True,
        request_id: str = "",
    ) -> RouteResult:
        started = time.perf_counter()
        table = self.table
        key = extract_key(
            body, settings=table.key_settings, path=path, tenant=tenant, complete=complete
        )
        if key.fallback is not None:
            self.callbacks.on_fallback(key.fallback)
        candidates, placement = table.lookup(key.value)
        if not candidates:
            decision = Decision(Outcome.NO_INSTANCES, None, None, None)
            self.callbacks.on_decision(decision, time.perf_counter() - started, request_id)
            return RouteResult(decision, key, None)
        names = [table.ids[c] for c in candidates]
        reservation, store, degraded = await self._reserve(names, placement, table, request_id)
        chosen = reservation.index
        reserved = names[chosen]
        self.callbacks.on_reserved(reserved)
        if degraded:
            outcome = Outcome.RING_ONLY
        else:
            outcome = Outcome.HOME if chosen == reservation.start else Outcome.SPILLED
        decision = Decision(
            outcome,
            reserved,
            table.header_for(key.value, candidates, chosen),
            names[reservation.start],
        )
        self.callbacks.on_decision(decision, time.perf_counter() - started, request_id)
        return RouteResult(decision, key, reserved, store)

    async def _reserve(
        self, names: list[str], placement: Placement | None, table: RoutingTable, request_id: str
    ) -> tuple[Reservation, LoadStore, bool]:
        """A reservation on fleet-wide counts, or on this replica's own when those are
        unavailable (then ``degraded`` is True)."""
        fleet_size = len(table.ids)
        now = time.monotonic()
        if now >= self._store_down_until:
            try:
                backstop = STORE_WAIT_FACTOR * table.config.redis_timeout_ms / 1000
                async with asyncio.timeout(backstop):
                    reservation = await self.store.reserve(
                        names, table.spill, fleet_size, request_id, placement
                    )
                if self._store_down:
                    self._store_down = False
                    log.warning("load store answers again: fleet-wide spill resumed")
                return reservation, self.store, False
            except (LoadsUnavailable, OSError, TimeoutError) as exc:
                self._store_down_until = now + STORE_BACKOFF_S
                if not self._store_down:
                    self._store_down = True
                    log.warning(
                        "load store unavailable (%r): routing by the ring and this "
                        "replica's own counts",
                        exc,
                    )
        reservation = await self.local.reserve(
            names, table.spill, fleet_size, request_id, placement
        )
        return reservation, self.local, True

    def finish(self, result: RouteResult) -> None:
        """The request ended (normally or not): give back its in-flight count."""
        if result.reserved is not None and result.store is not None:
            result.store.release(result.reserved)
            self.callbacks.on_finished(result.reserved)
