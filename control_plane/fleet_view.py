"""The fleet view: what every instance's vLLM says, next to what the router decided.

:class:`FleetView` is the control plane's one picture of the fleet, for the
admin API's ``GET /fleet`` (the status page) and the ``/metrics`` collector:

* every ``interval_s`` (default 2 s) it fetches each instance's ``/metrics``,
  concurrently, each bounded by ``timeout_s``, and parses it
  (:mod:`control_plane.vllm_metrics`; real vLLM names, any label set, missing
  metrics tolerated). An instance that does not answer, or answers something
  that is not Prometheus text, is shown as down with the reason;
* :meth:`FleetView.refresh` reads the shared state (fleet, config) and the load
  store's in-flight counts, decision counts and recent spills from Redis
  (:mod:`control_plane.loads_view`); the admin routes call it on every request,
  so a config or fleet change shows at once, not at the next scrape;
* with it, the report of ``prefix-router up``'s supervisor, when there is one
  (:mod:`prefix_router.state.supervision`): each process, its restarts and the
  recent exits, for the status page's process table and the restart metrics.

Rates are over a sliding window (``window_s``, default 60 s): the change of
each counter between the oldest and the newest reading inside the window.
``*_cumulative`` values are since each server started. Per instance: prefix
cache hit rate (tokens hit / tokens queried), TTFT p50/p99 from the histogram
buckets, running and waiting requests, KV usage, fleet-wide in-flight count
and the share of the ring's key space it owns (the ring ext_proc mirrors:
:meth:`prefix_router.core.table.RoutingTable.build`). Fleet-wide: hit rate and
TTFT over all instances, and the routing's predicted affinity (the share of
decisions that went home) beside vLLM's measured hit rate.

Cost per scrape round: one HTTP request per instance and one Redis round trip;
snapshots are built from memory in O(instances x buckets).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

import httpx
from redis.exceptions import RedisError

from control_plane.loads_view import LoadsReading, affinity, read_loads
from control_plane.vllm_metrics import (
    MetricsFormatError,
    VllmDelta,
    VllmReading,
    learned_rate,
    parse_vllm_metrics,
    reading_delta,
    sum_deltas,
)
from prefix_router.core.decision import DecisionRule, in_flight_bound
from prefix_router.core.fleet import Instance
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import InstanceModel, model_text, rates_by_group
from prefix_router.state.store import State, StateError, StateStore
from prefix_router.state.supervision import SupervisionReport, read_report

log = logging.getLogger("prefix_router.control_plane.fleet")

__all__ = ["FleetSnapshot", "FleetStats", "FleetView", "InstanceStats", "Window"]

T = TypeVar("T")


class Window(Generic[T]):
    """Timestamped values of one series over the last ``span_s`` seconds.

    The newest value that is at least ``span_s`` old stays as the baseline, so a
    rate covers the whole span (more after a gap in the readings, never less
    once two readings exist).
    """

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self.items: deque[tuple[float, T]] = deque()

    def add(self, now: float, value: T) -> None:
        self.items.append((now, value))
        while len(self.items) > 1 and self.items[1][0] <= now - self.span_s:
            self.items.popleft()

    @property
    def oldest(self) -> T | None:
        return self.items[0][1] if len(self.items) > 1 else None

    @property
    def newest(self) -> T | None:
        return self.items[-1][1] if self.items else None

    def current(self, now: float) -> bool:
        """Whether its newest reading is within the span: a window an instance that
        stopped answering left behind keeps its last minute for good otherwise."""
        return bool(self.items) and now - self.items[-1][0] <= self.span_s

    @property
    def elapsed_s(self) -> float:
        """Seconds between the oldest and the newest reading."""
        return self.items[-1][0] - self.items[0][0] if self.items else 0.0


@dataclass(frozen=True, slots=True)
class Scrape:
    """The latest scrape of one instance (``at``: monotonic seconds)."""

    at: float
    reading: VllmReading | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class InstanceStats:
    id: str
    address: str
    port: int
    weight: int
    state: str
    healthy: bool
    routable: bool
    removing: bool
    ring_share: float
    in_flight: int | None
    up: bool
    error: str | None
    scrape_age_s: float | None
    hit_rate: float | None
    hit_rate_cumulative: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_p50_s_cumulative: float | None
    ttft_p99_s_cumulative: float | None
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None
    prefix_cache_queries: float | None
    prefix_cache_hits: float | None


@dataclass(frozen=True, slots=True)
class FleetStats:
    hit_rate: float | None = None
    hit_rate_cumulative: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    ttft_p50_s_cumulative: float | None = None
    ttft_p99_s_cumulative: float | None = None
    running: float | None = None
    waiting: float | None = None
    in_flight: int | None = None
    predicted_affinity: float | None = None
    predicted_affinity_cumulative: float | None = None
    decisions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    time: float
    fleet_version: int
    config_version: int
    concurrency_threshold: int | None
    spill_policy: str
    spill_limit: int
    window_s: float
    scrape_interval_s: float
    instances: tuple[InstanceStats, ...]
    fleet: FleetStats
    spills: tuple[dict[str, Any], ...]
    loads_error: str | None
    state_error: str | None
    supervision: SupervisionReport | None = None
    """``prefix-router up``'s processes; ``None`` when not run by ``up``."""

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def instance_stats(
    instance: Instance,
    *,
    removing: bool,
    ring_share: float,
    in_flight: int | None,
    scrape: Scrape | None,
    window: Window[VllmReading] | None,
    now: float,
) -> InstanceStats:
    """One instance's row: pure, from what was read."""
    newest = window.newest if window else None
    recent = window is not None and window.current(now)
    delta = (
        reading_delta(newest, window.oldest)
        if window and recent and newest and window.oldest
        else None
    )
    up = scrape is not None and scrape.error is None
    live = scrape.reading if up and scrape is not None else None
    return InstanceStats(
        id=instance.id,
        address=instance.address,
        port=instance.port,
        weight=instance.weight,
        state=instance.state.value,
        healthy=instance.healthy,
        routable=instance.routable,
        removing=removing,
        ring_share=ring_share,
        in_flight=in_flight,
        up=up,
        error=scrape.error if scrape else "not scraped yet",
        scrape_age_s=None if scrape is None else max(0.0, now - scrape.at),
        hit_rate=delta.hit_rate if delta else None,
        hit_rate_cumulative=newest.hit_rate if newest else None,
        ttft_p50_s=delta.ttft(0.5) if delta else None,
        ttft_p99_s=delta.ttft(0.99) if delta else None,
        ttft_p50_s_cumulative=reading_delta(newest, None).ttft(0.5) if newest else None,
        ttft_p99_s_cumulative=reading_delta(newest, None).ttft(0.99) if newest else None,
        running=live.running if live else None,
        waiting=live.waiting if live else None,
        kv_cache_usage=live.kv_cache_usage if live else None,
        prefix_cache_queries=newest.prefix_cache_queries if newest else None,
        prefix_cache_hits=newest.prefix_cache_hits if newest else None,
    )


def fleet_stats(
    windows: list[Window[VllmReading]],
    rows: list[InstanceStats],
    loads: LoadsReading,
    decisions: Window[tuple[int, int]],
    *,
    now: float | None = None,
) -> FleetStats:
    """Fleet-wide figures: counters summed over instances, histograms merged. The last
    minute's are over the instances read in it (``now``: None takes every window as
    current); the cumulative ones over every instance ever read."""
    window_deltas: list[VllmDelta] = []
    totals: list[VllmDelta] = []
    for w in windows:
        if w.newest is not None:
            totals.append(reading_delta(w.newest, None))
            if w.oldest is not None and (now is None or w.current(now)):
                window_deltas.append(reading_delta(w.newest, w.oldest))
    recent, total = sum_deltas(window_deltas), sum_deltas(totals)
    running = [r.running for r in rows if r.running is not None]
    waiting = [r.waiting for r in rows if r.waiting is not None]
    predicted = None
    if decisions.newest is not None and decisions.oldest is not None:
        (home, spilled), (home0, spilled0) = decisions.newest, decisions.oldest
        if home < home0 or spilled < spilled0:  # the namespace was reset
            home0 = spilled0 = 0
        predicted = affinity(home - home0, spilled - spilled0)
    return FleetStats(
        hit_rate=recent.hit_rate,
        hit_rate_cumulative=total.hit_rate,
        ttft_p50_s=recent.ttft(0.5),
        ttft_p99_s=recent.ttft(0.99),
        ttft_p50_s_cumulative=total.ttft(0.5),
        ttft_p99_s_cumulative=total.ttft(0.99),
        running=sum(running) if running else None,
        waiting=sum(waiting) if waiting else None,
        in_flight=sum(loads.in_flight.values()) if loads.available else None,
        predicted_affinity=predicted,
        predicted_affinity_cumulative=loads.predicted_affinity,
        decisions=dict(loads.decisions),
    )


class FleetView:
    """Scrapes the fleet and reads the load store; :meth:`snapshot` is the current picture."""

    def __init__(
        self,
        store: StateStore,
        *,
        client: httpx.AsyncClient | None = None,
        interval_s: float = 2.0,
        window_s: float = 60.0,
        timeout_s: float = 1.0,
        redis_timeout_s: float = 0.5,
        metrics_path: str = "/metrics",
        recent_spills: int = 20,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.client = client or httpx.AsyncClient(timeout=timeout_s)
        self.interval_s = interval_s
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.redis_timeout_s = redis_timeout_s
        self.metrics_path = metrics_path
        self.recent_spills = recent_spills
        self.clock = clock
        self.wall_clock = wall_clock
        self.state: State | None = None
        self.state_error: str | None = "not read yet"
        self.loads = LoadsReading(error="not read yet")
        self.supervision: SupervisionReport | None = None
        self.scrapes: dict[str, Scrape] = {}
        self.windows: dict[str, Window[VllmReading]] = {}
        self.decisions: Window[tuple[int, int]] = Window(window_s)
        self.last_round_s: float | None = None
        self._share_key: tuple[int, int] | None = None
        self._share: dict[str, float] = {}

    # -- reading ----------------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-read the shared state and the load store (bounded; failures are recorded)."""
        try:
            async with asyncio.timeout(self.redis_timeout_s * 2):
                self.state = await self.store.read()
            self.state_error = None
        except (StateError, TimeoutError) as exc:
            self.state_error = str(exc) or "timed out reading the shared state"
        self.loads = await read_loads(
            self.store.redis,
            self.store.keys.namespace,
            spills=self.recent_spills,
            timeout_s=self.redis_timeout_s,
        )
        if self.loads.available:  # else Redis is down: keep the last report
            try:
                async with asyncio.timeout(self.redis_timeout_s):
                    self.supervision = await read_report(
                        self.store.redis, self.store.keys.namespace
                    )
            except TimeoutError:
                pass

    def learned_models(self) -> dict[str, str]:
        """What the instances' metrics taught of them, as the routing store reads it
        (:func:`~prefix_router.core.work.model_text`): ``rate capacity`` (0 where unknown),
        and the instance's ``vllm:num_requests_waiting`` with the time it was read, when its
        latest scrape succeeded (ConcurrencyThreshold then sees waiting requests the routers
        did not send).

        The capacity is each instance's own KV cache size. The prefill rate is the median
        of what the instances serving the same models showed over the window
        (:func:`~prefix_router.core.work.rates_by_group`): alike instances share one rate,
        and a fleet serving two models of different sizes gets one for each.
        """
        learned: dict[str, float | None] = {}
        capacities: dict[str, float] = {}
        waiting: dict[str, int] = {}
        for instance_id, window in self.windows.items():
            newest = window.newest
            if newest is None:
                continue
            learned[instance_id] = learned_rate(newest, window.oldest, window.elapsed_s)
            capacities[instance_id] = newest.kv_cache_tokens or 0.0
            latest = self.scrapes.get(instance_id)
            if latest is not None and latest.reading is newest and newest.waiting is not None:
                waiting[instance_id] = round(newest.waiting)
        instances = self.state.fleet.fleet.instances if self.state else ()
        rates = rates_by_group(learned, {i.id: i.base_models for i in instances})
        now = self.wall_clock()
        return {
            instance_id: model_text(
                InstanceModel(rates[instance_id], capacity, waiting.get(instance_id, 0)),
                now if instance_id in waiting else None,
            )
            for instance_id, capacity in capacities.items()
        }

    async def publish_models(self) -> None:
        """Write :meth:`learned_models` for every ext_proc replica (bounded; best effort:
        the routers keep the last values, or their defaults)."""
        models = self.learned_models()
        if not models:
            return
        try:
            async with asyncio.timeout(self.redis_timeout_s):
                key = f"{self.store.keys.namespace}models"
                await self.store.redis.hset(key, mapping=dict(models.items()))
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("cannot publish the learned instance models: %r", exc)

    async def scrape(self, instance: Instance) -> Scrape:
        url = f"http://{instance.id}{self.metrics_path}"
        try:
            response = await self.client.get(url, timeout=self.timeout_s)
            response.raise_for_status()
            reading = parse_vllm_metrics(response.text)
        except (httpx.HTTPError, httpx.InvalidURL, MetricsFormatError) as exc:
            return Scrape(self.clock(), None, f"{type(exc).__name__}: {exc}"[:300])
        return Scrape(self.clock(), reading)

    async def tick(self) -> None:
        """One round: refresh, scrape every instance concurrently, record the windows."""
        started = self.clock()
        await self.refresh()
        instances = self.state.fleet.fleet.instances if self.state else ()
        results = await asyncio.gather(*(self.scrape(i) for i in instances))
        ids = {i.id for i in instances}
        for gone in set(self.scrapes) - ids:
            self.scrapes.pop(gone, None)
            self.windows.pop(gone, None)
        for instance, result in zip(instances, results, strict=True):
            before = self.scrapes.get(instance.id)
            if result.error and (before is None or before.error is None):
                log.info(
                    "cannot read metrics of %s: %s",
                    instance.id,
                    result.error,
                    extra={"instance": instance.id},
                )
            elif result.error is None and before is not None and before.error is not None:
                log.info(
                    "reading metrics of %s again", instance.id, extra={"instance": instance.id}
                )
            self.scrapes[instance.id] = result
            if result.reading is not None:
                self.windows.setdefault(instance.id, Window(self.window_s)).add(
                    result.at, result.reading
                )
        await self.publish_models()
        if self.loads.available:
            home = self.loads.decisions.get("home", 0)
            self.decisions.add(started, (home, self.loads.decisions.get("spilled", 0)))
        self.last_round_s = self.clock() - started

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # never let the view die; the next round retries
                log.exception("fleet scrape round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def close(self) -> None:
        await self.client.aclose()

    # -- the picture ------------------------------------------------------------------

    def ring_share(self) -> dict[str, float]:
        """Key-space share per routable instance, from the ring ext_proc builds (cached)."""
        if self.state is None:
            return {}
        key = self.state.versions
        if key != self._share_key:
            table = RoutingTable.build(self.state.fleet.fleet, self.state.config.config)
            self._share, self._share_key = table.ring.share(), key
        return self._share

    def snapshot(self) -> FleetSnapshot:
        now = self.clock()
        state = self.state
        instances = state.fleet.fleet.instances if state else ()
        removing = state.fleet.removing if state else frozenset()
        config = state.config.config if state else None
        share = self.ring_share()
        loads = self.loads
        rows = [
            instance_stats(
                inst,
                removing=inst.id in removing,
                ring_share=share.get(inst.id, 0.0),
                in_flight=loads.in_flight.get(inst.id, 0) if loads.available else None,
                scrape=self.scrapes.get(inst.id),
                window=self.windows.get(inst.id),
                now=now,
            )
            for inst in instances
        ]
        windows = [self.windows[i.id] for i in instances if i.id in self.windows]
        totals = fleet_stats(windows, rows, loads, self.decisions, now=now)
        rule = DecisionRule.from_config(config) if config else None
        routable = sum(1 for i in instances if i.routable)
        return FleetSnapshot(
            time=self.wall_clock(),
            fleet_version=state.fleet.fleet.version if state else 0,
            config_version=state.config.version if state else 0,
            concurrency_threshold=config.concurrency_threshold if config else None,
            spill_policy=config.spill.policy.value if config else "",
            spill_limit=(
                math.ceil(in_flight_bound(rule, totals.in_flight or 0, routable)) if rule else 0
            ),
            window_s=self.window_s,
            scrape_interval_s=self.interval_s,
            instances=tuple(rows),
            fleet=totals,
            spills=loads.spills,
            loads_error=loads.error,
            state_error=self.state_error,
            supervision=self.supervision,
        )
