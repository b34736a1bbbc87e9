"""Prometheus metrics of one ext_proc process (prefix ``prefix_router_ext_proc_``).

Served on ``--metrics-port`` at ``/metrics``. Fleet-wide in-flight counts are
exported once, by the control plane, from Redis; this process exports its own
share so a replica that leaks counts stands out.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ext_proc.router import RouteDecision, RouterCallbacks
from prefix_router.core.decision import Outcome
from prefix_router.core.key import Fallback

log = logging.getLogger("prefix_router.ext_proc")

DECISION_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.4,
    0.5,
    0.75,
    1.0,
)
"""Up to Envoy's ext_proc message timeout (500 ms) and past it: a decision may wait for
the shared store up to 400 ms (``ext_proc.router.STORE_WAIT_CAP_S``)."""


class PrometheusCallbacks(RouterCallbacks):
    """Counts every decision, fallback and error; logs spills with their request id."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter(
            "prefix_router_ext_proc_decisions",
            "Routing decisions by outcome: home (to an instance holding the longest prefix), "
            "placed (nobody holds it), spilled (away from its holders: their queues outweighed "
            "their cache), ring_only (routing store unavailable), no_instances, unknown_model "
            "(no instance serves the request's model: answered 404 by ext_proc), error.",
            ["outcome"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "prefix_router_ext_proc_decision_seconds",
            "Time from the request body's arrival to the routing decision.",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.pool_decisions = Counter(
            "prefix_router_ext_proc_pool_decisions",
            "Routing decisions by pool: the request's model when the fleet declares models "
            "(* for the catch-all), empty for the whole fleet. Unknown models are not a pool "
            "(decisions_total{outcome=unknown_model}).",
            ["pool"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "prefix_router_ext_proc_key_fallbacks",
            "Requests keyed on raw bytes because openai mode could not render them, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "prefix_router_ext_proc_in_flight",
            "Requests this replica routed that have not ended, by instance.",
            ["instance_id"],
            registry=self.registry,
        )
        self.release_failures = Counter(
            "prefix_router_ext_proc_release_failures",
            "Routed requests whose end could not be recorded (their in-flight count given "
            "back, then their blocks written): the request itself was not affected.",
            registry=self.registry,
        )
        self.open_streams = Gauge(
            "prefix_router_ext_proc_open_streams",
            "ext_proc gRPC streams open right now (one per request in flight through Envoy).",
            registry=self.registry,
        )
        self.stream_ends = Counter(
            "prefix_router_ext_proc_stream_ends",
            "ext_proc streams ended, by how: closed (Envoy's graceful close, the normal end) "
            "or reset (a client abort, or an Envoy without graceful close: see the bootstrap).",
            ["how"],
            registry=self.registry,
        )
        self._closed, self._reset = (self.stream_ends.labels(h) for h in ("closed", "reset"))
        self.asyncio_tasks = Gauge(
            "prefix_router_ext_proc_asyncio_tasks",
            "asyncio tasks alive in this process (a leak shows as growth at rest).",
            registry=self.registry,
        )
        self.http2_breaches = Counter(
            "prefix_router_ext_proc_http2_limit_breaches",
            "Peers held to a limit of the HTTP/2 server, by limit (a --h2-* flag, or "
            "protocol_error): each one closed a connection, reset a stream or refused one.",
            ["limit"],
            registry=self.registry,
        )
        self.metrics_refused = Counter(
            "prefix_router_ext_proc_metrics_connections_refused",
            "Connections to this metrics port closed at once because its connection limit "
            "was reached (ext_proc/metrics_server.py).",
            registry=self.registry,
        )
        self.http2_connections = Gauge(
            "prefix_router_ext_proc_http2_connections",
            "HTTP/2 connections open on this process's gRPC server.",
            registry=self.registry,
        )
        self.http2_partial_bytes = Gauge(
            "prefix_router_ext_proc_http2_partial_bytes",
            "Bytes of unfinished request messages held (against --h2-process-partial-bytes).",
            registry=self.registry,
        )
        # Children looked up once: labels() costs more than the increment (hot path).
        self._decided = {o: self.decisions.labels(o.value) for o in Outcome}
        self._errors = self.decisions.labels("error")
        self._fallen_back = {r: self.fallbacks.labels(r.value) for r in Fallback}
        self._in_flight_of: dict[str, Gauge] = {}
        self._in_flight_count: dict[str, int] = {}
        self._routed_over: frozenset[str] | None = None
        """The current table's instances (None: no table seen yet)."""
        self._pool_of: dict[str, Counter] = {}

    def watch_store(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Export how the shared routing store's decisions were made: ``counts()`` gives
        those made at once on the replica's copy and those that waited for a round trip."""
        self.registry.register(_StoreDecisions(counts))

    def on_decision(self, decision: RouteDecision, seconds: float, request_id: str) -> None:
        self._decided[decision.outcome].inc()
        if decision.outcome is not Outcome.UNKNOWN_MODEL:  # a client's names: unbounded
            pool = self._pool_of.get(decision.pool)
            if pool is None:
                pool = self._pool_of[decision.pool] = self.pool_decisions.labels(decision.pool)
            pool.inc()
        self.decision_seconds.observe(seconds)
        if decision.outcome is Outcome.SPILLED:
            log.info(
                "spilled from %s to %s",
                decision.home_id,
                decision.instance_id,
                extra={
                    "instance": decision.instance_id,
                    "outcome": "spilled",
                    "request_id": request_id,
                },
            )

    def _in_flight(self, instance_id: str) -> Gauge:
        child = self._in_flight_of.get(instance_id)
        if child is None:
            child = self._in_flight_of[instance_id] = self.in_flight.labels(instance_id)
        return child

    def on_reserved(self, instance_id: str) -> None:
        self._in_flight(instance_id).inc()
        self._in_flight_count[instance_id] = self._in_flight_count.get(instance_id, 0) + 1

    def on_finished(self, instance_id: str) -> None:
        self._in_flight(instance_id).dec()
        left = self._in_flight_count[instance_id] = self._in_flight_count.get(instance_id, 1) - 1
        if left <= 0 and self._routed_over is not None and instance_id not in self._routed_over:
            self._forget(instance_id)

    def on_table(self, instance_ids: tuple[str, ...]) -> None:
        """An instance gone from the table keeps its series only while requests it took
        are still running: a fleet that changes over weeks must not grow them for good."""
        self._routed_over = frozenset(instance_ids)
        for instance_id in list(self._in_flight_of):
            if instance_id not in self._routed_over and not self._in_flight_count.get(instance_id):
                self._forget(instance_id)

    def _forget(self, instance_id: str) -> None:
        self._in_flight_of.pop(instance_id, None)
        self._in_flight_count.pop(instance_id, None)
        with contextlib.suppress(KeyError):
            self.in_flight.remove(instance_id)

    def on_release_failed(self, error: BaseException) -> None:
        self.release_failures.inc()

    def on_fallback(self, reason: Fallback) -> None:
        self._fallen_back[reason].inc()

    def on_error(self, error: BaseException) -> None:
        self._errors.inc()

    def on_http2_breach(self, limit: str) -> None:
        self.http2_breaches.labels(limit).inc()

    def on_stream_end(self, reset: bool) -> None:
        (self._reset if reset else self._closed).inc()


class _StoreDecisions(Collector):
    """``prefix_router_ext_proc_store_decisions_total{how}``, read from the store's counts."""

    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        at_once, waited = self._counts()
        family = CounterMetricFamily(
            "prefix_router_ext_proc_store_decisions",
            "Decisions on the fleet's shared routing state, by how: copy (at once, on this "
            "replica's copy of it, refreshed within redis_max_staleness_ms) or round_trip "
            "(after waiting for a Redis round trip: the copy was older, or not loaded).",
            labels=["how"],
        )
        family.add_metric(["copy"], at_once)
        family.add_metric(["round_trip"], waited)
        yield family
