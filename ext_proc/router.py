"""The request router: key -> decision -> header, for one request.

This is the part of ext_proc that knows nothing about gRPC. It holds the current
:class:`~prefix_router.core.table.RoutingTable` (swapped whole when the fleet or the config
changes) and a :class:`~prefix_router.state.routing.RoutingStore`, which decides with the
one decision function over the fleet's shared state.

The store bounds its own waits on Redis (``redis_timeout_ms`` per round trip) and reports
a failed or slow Redis as :class:`StateUnavailable`: the request is then decided on this
replica's own state (``RING_ONLY``): the same decision over what this replica has routed,
so a hot prefix is still spread, if less evenly. The failure is logged once, and the
store is left alone for a short back-off so a dead Redis costs each request nothing; the
first success after that logs the recovery. Time a request spends queued in this process
under a burst is not Redis being slow, so it does not count against Redis; a backstop of
``STORE_WAIT_FACTOR`` round trips still bounds the wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from prefix_router.core.decision import Outcome
from prefix_router.core.key import Fallback, PrefixKey, extract_key
from prefix_router.core.pools import unknown_model_body
from prefix_router.core.table import Pool, RoutingTable
from prefix_router.envoy.bootstrap import DEFAULT_EXT_PROC_TIMEOUT_MS
from prefix_router.state.clock import scaled_clock
from prefix_router.state.routing import InProcessStore, Routed, RoutingStore, StateUnavailable

log = logging.getLogger("prefix_router.ext_proc")

STORE_BACKOFF_S = 0.5
STORE_WAIT_FACTOR = 10
STORE_WAIT_SHARE = 0.8
"""Of Envoy's ext_proc message timeout, what a request may spend waiting on the shared
store: past the timeout the request would go on unrouted, so the wait ends in time to
decide on this replica's own state instead."""
STORE_WAIT_CAP_S = STORE_WAIT_SHARE * DEFAULT_EXT_PROC_TIMEOUT_MS / 1000
"""The cap with Envoy's default message timeout (500 ms)."""


def store_wait_s(redis_timeout_ms: float, cap_s: float = STORE_WAIT_CAP_S) -> float:
    """How long a request may wait for the shared store: ``STORE_WAIT_FACTOR`` round trips
    (time queued behind a burst is not Redis being slow), within ``cap_s``."""
    return min(STORE_WAIT_FACTOR * redis_timeout_ms / 1000, cap_s)


class RouterCallbacks:
    """Hooks for metrics and logs; every method is a no-op by default."""

    def on_decision(self, routed: RouteDecision, seconds: float, request_id: str) -> None:
        """A request was routed; ``seconds`` is the decision's latency."""

    def on_fallback(self, reason: Fallback) -> None:
        """``openai`` key extraction fell back to ``bytes``."""

    def on_reserved(self, instance_id: str) -> None:
        """A request now counts as in flight on ``instance_id``."""

    def on_finished(self, instance_id: str) -> None:
        """A request counted on ``instance_id`` ended."""

    def on_error(self, error: BaseException) -> None:
        """Routing failed with an unexpected error; the request went on unrouted."""

    def on_release_failed(self, error: BaseException) -> None:
        """Giving a routed request's count back, or writing its blocks, failed."""

    def on_table(self, instance_ids: tuple[str, ...]) -> None:
        """New requests are routed over these instances from now on."""

    def on_stream_end(self, reset: bool) -> None:
        """An ext_proc stream ended: closed by Envoy's half-close, or ``reset``."""


class RouteDecision(NamedTuple):
    """Where one request goes, as ext_proc applies and reports it."""

    outcome: Outcome
    instance_id: str | None
    header_value: str | None
    """The ``x-prefix-key`` value that makes Envoy pick ``instance_id`` (None: unrouted)."""
    home_id: str | None
    """The instance holding the longest prefix of the request (None: nobody did)."""
    cached_tokens: int = 0
    """Tokens of the prompt the instance is expected to have cached."""
    pool_header: str | None = None
    """The ``x-prefix-pool`` value (the pool's Envoy cluster); None: the whole fleet."""
    pool: str = ""
    """The request's pool (its model, ``*`` the catch-all); empty: the whole fleet."""


@dataclass(slots=True)
class RouteResult:
    decision: RouteDecision
    key: PrefixKey
    reserved: str | None
    """Instance id whose in-flight count this request holds, to release at its end."""
    store: RoutingStore | None = None
    """The store holding that count."""
    prefill_end: float = 0.0
    """When the store modelled the request's prefill to end (see ``RoutingStore.release``)."""
    answer: bytes | None = None
    """Set when the router answers the request itself (an unknown model: a 404 body)."""


class PendingRoute(NamedTuple):
    """A request keyed and pooled, waiting for its decision (:meth:`RequestRouter.finish_route`)."""

    key: PrefixKey
    table: RoutingTable
    pool: Pool
    request_id: str
    started: float
    """``perf_counter`` when routing began: the decision's latency counts from there."""


class RequestRouter:
    def __init__(
        self,
        table: RoutingTable,
        store: RoutingStore | None,
        callbacks: RouterCallbacks | None = None,
        clock_scale: float = 1.0,
        envoy_timeout_ms: float = DEFAULT_EXT_PROC_TIMEOUT_MS,
    ) -> None:
        """``store`` is the state shared with the other replicas; None: this replica
        routes alone, on its own state. ``clock_scale``: the instances' seconds per wall
        second (1 for vLLM; a simulator's time scale), so modelled queues drain at the
        speed the instances work. ``envoy_timeout_ms``: Envoy's ext_proc message timeout,
        which bounds a request's wait on the shared store (:data:`STORE_WAIT_SHARE`)."""
        self.table = table
        self.store_wait_cap_s = STORE_WAIT_SHARE * envoy_timeout_ms / 1000
        self.local = InProcessStore(scaled_clock(clock_scale))
        """This replica's own state: all of it when alone, else decided on while the
        shared store is unavailable."""
        self.alone = store is None
        self.store: RoutingStore = self.local if store is None else store
        self.callbacks = callbacks or RouterCallbacks()
        self._store_down_until = 0.0
        self._store_down = False

    def use(self, table: RoutingTable) -> None:
        """Route new requests with ``table``; requests in flight keep theirs."""
        self.table = table
        self.callbacks.on_table(table.ids)

    async def route(
        self,
        body: bytes,
        *,
        path: str,
        tenant: str,
        complete: bool = True,
        request_id: str = "",
    ) -> RouteResult:
        """Route one request: at once when the store can decide without waiting, else
        after its round trip."""
        begun = self.route_at_once(
            body, path=path, tenant=tenant, complete=complete, request_id=request_id
        )
        return begun if isinstance(begun, RouteResult) else await self.finish_route(begun)

    def route_at_once(
        self,
        body: bytes,
        *,
        path: str,
        tenant: str,
        complete: bool = True,
        request_id: str = "",
    ) -> RouteResult | PendingRoute:
        """The request's result if it needs no waiting (the usual case: the store decides
        on state it holds), else a :class:`PendingRoute` to :meth:`finish_route`.
        Answering in the same turn of the event loop saves ext_proc a task and a loop
        turn per request."""
        started = time.perf_counter()
        prepared = self._prepare(body, path, tenant, complete, request_id, started)
        if isinstance(prepared, RouteResult):
            return prepared
        pending = PendingRoute(*prepared, request_id, started)
        decided = self._route_at_once(pending.key, pending.table, request_id)
        return pending if decided is None else self._result(pending, decided)

    async def finish_route(self, pending: PendingRoute) -> RouteResult:
        """The result of a request :meth:`route_at_once` could not decide at once."""
        return self._result(
            pending, await self._route(pending.key, pending.table, pending.request_id)
        )

    def _prepare(
        self, body: bytes, path: str, tenant: str, complete: bool, request_id: str, started: float
    ) -> RouteResult | tuple[PrefixKey, RoutingTable, Pool]:
        """The request's key, table and pool, or its result already when no instance
        needs choosing (an unknown model, an empty pool)."""
        table = self.table
        key = extract_key(
            body, settings=table.key_settings, path=path, tenant=tenant, complete=complete
        )
        if key.fallback is not None:
            self.callbacks.on_fallback(key.fallback)
        pool = table.pool_for(key.model)
        if pool is None:  # no instance serves it: answer without touching any
            decision = RouteDecision(Outcome.UNKNOWN_MODEL, None, None, None, pool=key.model or "")
            self.callbacks.on_decision(decision, time.perf_counter() - started, request_id)
            answer = unknown_model_body(key.model or "")
            return RouteResult(decision, key, None, answer=answer)
        if not pool.members:  # Envoy's cluster still decides (it may route in panic)
            decision = RouteDecision(
                Outcome.NO_INSTANCES, None, None, None, pool_header=pool.header, pool=pool.name
            )
            self.callbacks.on_decision(decision, time.perf_counter() - started, request_id)
            return RouteResult(decision, key, None)
        return key, table, pool

    def _result(
        self, pending: PendingRoute, decided: tuple[Routed, RoutingStore, bool]
    ) -> RouteResult:
        key, table, pool, request_id, started = pending
        routed, store, degraded = decided
        made = routed.decision
        self.callbacks.on_reserved(routed.instance_id)
        decision = RouteDecision(
            Outcome.RING_ONLY if degraded else made.outcome,
            routed.instance_id,
            table.header_for(key.value, routed.ring_order, made.instance, pool),
            None if made.home is None else table.ids[made.home],
            made.cached_tokens,
            pool.header,
            pool.name,
        )
        self.callbacks.on_decision(decision, time.perf_counter() - started, request_id)
        return RouteResult(decision, key, routed.instance_id, store, routed.prefill_end)

    def _route_at_once(
        self, key: PrefixKey, table: RoutingTable, request_id: str
    ) -> tuple[Routed, RoutingStore, bool] | None:
        """A decision that needs no waiting: this replica's own state when it routes
        alone or the shared store is in its back-off, or the shared store's at-once
        decision (None: wait for :meth:`_route`)."""
        if self.alone:
            return self.local.route_now(key, table), self.local, False
        if time.monotonic() < self._store_down_until:
            return self.local.route_now(key, table), self.local, True
        routed = self.store.route_at_once(key, table, request_id)
        if routed is None:
            return None
        self._store_answers()
        return routed, self.store, False

    def _store_answers(self) -> None:
        if self._store_down:
            self._store_down = False
            log.warning("routing store answers again: fleet-wide routing resumed")

    async def _route(
        self, key: PrefixKey, table: RoutingTable, request_id: str
    ) -> tuple[Routed, RoutingStore, bool]:
        """A decision on the fleet's shared state after waiting for it, or on this
        replica's own when that is unavailable (then ``degraded`` is True)."""
        if time.monotonic() >= self._store_down_until:
            try:
                wait = store_wait_s(table.config.redis_timeout_ms, self.store_wait_cap_s)
                async with asyncio.timeout(wait):
                    routed = await self.store.route(key, table, request_id)
                self._store_answers()
                return routed, self.store, False
            except (StateUnavailable, OSError, TimeoutError) as exc:
                # from the failure, not the start: a slow failure leaves a back-off too
                self._store_down_until = time.monotonic() + STORE_BACKOFF_S
                if not self._store_down:
                    self._store_down = True
                    log.warning(
                        "routing store unavailable (%r): deciding on this replica's own state",
                        exc,
                    )
        routed = await self.local.route(key, table, request_id)
        return routed, self.local, True

    def finish(self, result: RouteResult) -> None:
        """The request ended (normally or not): give back its in-flight count, and mark
        its blocks used until now on its instance (``RoutingStore.release``)."""
        if result.reserved is not None and result.store is not None:
            try:  # the stores give the count back first, then write the index
                result.store.release(result.reserved, result.prefill_end, result.key.blocks)
            except Exception as exc:  # noqa: BLE001 - a request's end must not fail its stream
                self.callbacks.on_release_failed(exc)
                log.exception("releasing a request failed")
            self.callbacks.on_finished(result.reserved)
