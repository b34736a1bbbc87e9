"""Prometheus metrics of the control plane (prefix ``prefix_router_control_plane_``).

Served at ``GET /metrics`` on the admin port. Everything is read when scraped,
by one custom collector, from what the process already holds:

* xDS, per client (``node``) and resource type (``cds``, ``eds``): responses
  pushed, ACKs, NACKs, open streams (from :class:`~control_plane.callbacks.ClientRegistry`);
* the shared state in Redis: fleet and config versions, the versions this
  replica published, instances by state and health, ConcurrencyThreshold;
* the load store in Redis: fleet-wide in-flight count per instance, decisions
  counted in Redis by outcome, predicted affinity. Exported here once, not by
  every ext_proc replica;
* the fleet view (:class:`~control_plane.fleet_view.FleetView`): each
  instance's vLLM prefix-cache counters, hit rate, TTFT quantiles, running and
  waiting requests and KV usage, fleet-wide hit rate and TTFT, and each
  instance's share of the ring's key space;
* under ``prefix-router up``, its supervisor's report (through Redis): each
  process's restarts and whether it runs now;
* this process's HTTP ports (admin, metrics): connections closed for breaching a limit
  (:data:`control_plane.http_server.BREACHES`).

``*_ratio`` gauges are fractions in [0, 1]; windowed ones are over the fleet
view's window (``--fleet-window``, 60 s). A value that is unknown (no traffic
in the window, instance down, Redis unavailable) is left out, not exported as 0.
The names are listed in ``METRIC_NAMES`` and documented in docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from control_plane.callbacks import ClientRegistry
from control_plane.fleet_view import FleetSnapshot, FleetView
from control_plane.http_server import BREACHES

__all__ = ["METRIC_NAMES", "PREFIX", "ControlPlaneCollector", "render"]

PREFIX = "prefix_router_control_plane_"

METRIC_NAMES: dict[str, str] = {
    # name (without prefix): type
    "xds_pushes_total": "counter",
    "xds_acks_total": "counter",
    "xds_nacks_total": "counter",
    "xds_streams": "gauge",
    "fleet_version": "gauge",
    "config_version": "gauge",
    "published_fleet_version": "gauge",
    "published_config_version": "gauge",
    "instances": "gauge",
    "concurrency_threshold": "gauge",
    "spill_limit": "gauge",
    "state_up": "gauge",
    "redis_up": "gauge",
    "in_flight": "gauge",
    "decisions_total": "counter",
    "predicted_affinity_ratio": "gauge",
    "predicted_affinity_cumulative_ratio": "gauge",
    "ring_share_ratio": "gauge",
    "instance_scrape_up": "gauge",
    "prefix_cache_queries_total": "counter",
    "prefix_cache_hits_total": "counter",
    "prefix_cache_hit_ratio": "gauge",
    "fleet_prefix_cache_hit_ratio": "gauge",
    "fleet_prefix_cache_hit_cumulative_ratio": "gauge",
    "time_to_first_token_seconds": "gauge",
    "fleet_time_to_first_token_seconds": "gauge",
    "requests_running": "gauge",
    "requests_waiting": "gauge",
    "kv_cache_usage_ratio": "gauge",
    "fleet_scrape_duration_seconds": "gauge",
    "component_restarts_total": "counter",
    "component_up": "gauge",
    "http_limit_breaches_total": "counter",
}

QUANTILES = (("0.5", "p50"), ("0.99", "p99"))


def _family(
    name: str, doc: str, labels: Iterable[str] = ()
) -> CounterMetricFamily | GaugeMetricFamily:
    kind = METRIC_NAMES[name]
    if kind == "counter":
        return CounterMetricFamily(PREFIX + name.removesuffix("_total"), doc, labels=list(labels))
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))


def split_version(version: str | None) -> tuple[float, float] | None:
    """A snapshot's ``version_info`` -> its fleet and config versions: ``"<fleet>.<config>"``,
    then digests when instances are named by DNS (``snapshot_version``) or the versions came
    back to one published with other content (``Publisher``). None for anything else."""
    fields = (version or "").split(".")
    if len(fields) < 2:
        return None
    try:
        return float(int(fields[0])), float(int(fields[1]))
    except ValueError:
        return None


class ControlPlaneCollector:
    """Yields every control-plane metric from the live objects, at scrape time."""

    def __init__(
        self,
        view: FleetView,
        clients: ClientRegistry,
        published_version: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.view = view
        self.clients = clients
        self.published_version = published_version

    def collect(self) -> Iterator[Metric]:
        yield from self._xds()
        snap = self.view.snapshot()
        yield from self._state(snap)
        yield from self._loads(snap)
        yield from self._instances(snap)
        yield from self._fleet(snap)
        yield from self._supervision(snap)
        yield self._http_breaches()

    def _xds(self) -> Iterator[Metric]:
        pushes = _family(
            "xds_pushes_total", "xDS responses sent, by client and type.", ["node", "type"]
        )
        acks = _family(
            "xds_acks_total", "xDS responses ACKed (applied), by client and type.", ["node", "type"]
        )
        nacks = _family(
            "xds_nacks_total",
            "xDS responses NACKed (rejected; Envoy kept its last good config), by client and type.",
            ["node", "type"],
        )
        streams = _family("xds_streams", "Open ADS streams, by client.", ["node"])
        self.clients.forget_gone()
        for client in self.clients.clients.values():
            for family, counts in (
                (pushes, client.pushes),
                (acks, client.acks),
                (nacks, client.nacks),
            ):
                for type_, count in sorted(counts.items()):
                    family.add_metric([client.node_id, type_], count)
            streams.add_metric([client.node_id], len(client.streams))
        yield from (pushes, acks, nacks, streams)

    def _state(self, snap: FleetSnapshot) -> Iterator[Metric]:
        up = _family("state_up", "1 if the last read of the shared state in Redis succeeded.")
        up.add_metric([], 0.0 if snap.state_error else 1.0)
        yield up
        if snap.fleet_version:
            fleet = _family("fleet_version", "Fleet version in the shared state.")
            fleet.add_metric([], snap.fleet_version)
            yield fleet
        if snap.config_version:
            config = _family("config_version", "Routing config version in the shared state.")
            config.add_metric([], snap.config_version)
            yield config
        published = split_version(self.published_version())
        if published is not None:
            for name, value in zip(
                ("published_fleet_version", "published_config_version"), published, strict=True
            ):
                family = _family(
                    name,
                    "Version in the xDS snapshot this replica serves "
                    "(behind the shared state: not yet published).",
                )
                family.add_metric([], value)
                yield family
        instances = _family(
            "instances", "Instances in the fleet by state and health.", ["state", "health"]
        )
        counts: dict[tuple[str, str], int] = {
            (s, h): 0 for s in ("active", "draining") for h in ("healthy", "unhealthy")
        }
        for row in snap.instances:
            key = (row.state, "healthy" if row.healthy else "unhealthy")
            counts[key] = counts.get(key, 0) + 1
        for (state, health), n in sorted(counts.items()):
            instances.add_metric([state, health], n)
        yield instances
        if snap.concurrency_threshold is not None:
            threshold = _family(
                "concurrency_threshold",
                "ConcurrencyThreshold: requests waiting for their first token at which an "
                "instance counts as overloaded (absent: no threshold).",
            )
            threshold.add_metric([], snap.concurrency_threshold)
            yield threshold
        if snap.spill_policy:
            limit = _family(
                "spill_limit",
                "In-flight count at which an instance takes no more requests now "
                "(load_factor x the fleet's mean in flight + 2).",
            )
            limit.add_metric([], snap.spill_limit)
            yield limit

    def _loads(self, snap: FleetSnapshot) -> Iterator[Metric]:
        up = _family("redis_up", "1 if the last read of the load store in Redis succeeded.")
        up.add_metric([], 0.0 if snap.loads_error else 1.0)
        yield up
        if snap.loads_error:
            return
        in_flight = _family(
            "in_flight",
            "Fleet-wide in-flight requests per instance (all ext_proc replicas, from Redis).",
            ["instance_id"],
        )
        for row in snap.instances:
            if row.in_flight is not None:
                in_flight.add_metric([row.id], row.in_flight)
        decisions = _family(
            "decisions_total",
            "Routing decisions counted in Redis by outcome "
            "(home, spilled); ring_only ones are not.",
            ["outcome"],
        )
        for outcome in ("home", "spilled"):
            decisions.add_metric([outcome], snap.fleet.decisions.get(outcome, 0))
        yield from (in_flight, decisions)
        for name, value, doc in (
            (
                "predicted_affinity_ratio",
                snap.fleet.predicted_affinity,
                "Share of decisions sent home (predicted cache affinity) over the window.",
            ),
            (
                "predicted_affinity_cumulative_ratio",
                snap.fleet.predicted_affinity_cumulative,
                "Share of decisions sent home since the namespace was created.",
            ),
        ):
            if value is not None:
                family = _family(name, doc)
                family.add_metric([], value)
                yield family

    def _instances(self, snap: FleetSnapshot) -> Iterator[Metric]:
        share = _family(
            "ring_share_ratio",
            "Share of the ring's key space an instance owns (0 if not routable).",
            ["instance_id"],
        )
        up = _family(
            "instance_scrape_up",
            "1 if the instance's /metrics was read in the last round, 0 if not; absent "
            "before the first round (and with the fleet view off).",
            ["instance_id"],
        )
        queries = _family(
            "prefix_cache_queries_total",
            "vLLM prefix-cache queries (tokens), as the instance reports them.",
            ["instance_id"],
        )
        hits = _family(
            "prefix_cache_hits_total",
            "vLLM prefix-cache hits (tokens), as the instance reports them.",
            ["instance_id"],
        )
        hit_ratio = _family(
            "prefix_cache_hit_ratio",
            "Prefix-cache hit rate (tokens hit / queried) over the window.",
            ["instance_id"],
        )
        ttft = _family(
            "time_to_first_token_seconds",
            "TTFT quantile over the window, from vLLM's histogram buckets.",
            ["instance_id", "quantile"],
        )
        running = _family("requests_running", "vLLM requests running.", ["instance_id"])
        waiting = _family("requests_waiting", "vLLM requests waiting.", ["instance_id"])
        kv = _family(
            "kv_cache_usage_ratio", "vLLM KV-cache usage (pinned blocks).", ["instance_id"]
        )
        for row in snap.instances:
            labels = [row.id]
            share.add_metric(labels, row.ring_share)
            if row.scrape_age_s is not None:  # not scraped (yet, or the fleet view is off)
                up.add_metric(labels, 1.0 if row.up else 0.0)
            for family, value in (
                (queries, row.prefix_cache_queries),
                (hits, row.prefix_cache_hits),
                (hit_ratio, row.hit_rate),
                (running, row.running),
                (waiting, row.waiting),
                (kv, row.kv_cache_usage),
            ):
                if value is not None:
                    family.add_metric(labels, value)
            for (quantile, _), value in zip(
                QUANTILES, (row.ttft_p50_s, row.ttft_p99_s), strict=True
            ):
                if value is not None:
                    ttft.add_metric([row.id, quantile], value)
        yield from (share, up, queries, hits, hit_ratio, ttft, running, waiting, kv)

    def _fleet(self, snap: FleetSnapshot) -> Iterator[Metric]:
        fleet = snap.fleet
        for name, value, doc in (
            (
                "fleet_prefix_cache_hit_ratio",
                fleet.hit_rate,
                "Fleet-wide prefix-cache hit rate over the window (all instances' tokens).",
            ),
            (
                "fleet_prefix_cache_hit_cumulative_ratio",
                fleet.hit_rate_cumulative,
                "Fleet-wide prefix-cache hit rate since each instance started.",
            ),
            (
                "fleet_scrape_duration_seconds",
                self.view.last_round_s,
                "Duration of the last round of scraping every instance.",
            ),
        ):
            if value is not None:
                family = _family(name, doc)
                family.add_metric([], value)
                yield family
        ttft = _family(
            "fleet_time_to_first_token_seconds",
            "Fleet-wide TTFT quantile over the window (merged histograms).",
            ["quantile"],
        )
        for (quantile, _), value in zip(
            QUANTILES, (fleet.ttft_p50_s, fleet.ttft_p99_s), strict=True
        ):
            if value is not None:
                ttft.add_metric([quantile], value)
        yield ttft

    def _supervision(self, snap: FleetSnapshot) -> Iterator[Metric]:
        report = snap.supervision
        if report is None:  # not run by ``prefix-router up``
            return
        restarts = _family(
            "component_restarts_total",
            "Restarts of a process of the stack by prefix-router up's supervisor "
            "(it exited unexpectedly; the reason is on the status page and in up's output).",
            ["component"],
        )
        up = _family(
            "component_up",
            "1 if the process runs (serving, as far as up's supervisor knows), "
            "0 while it is down or restarting.",
            ["component"],
        )
        for component in report.components:
            restarts.add_metric([component.name], component.restarts)
            up.add_metric([component.name], 1.0 if component.state == "running" else 0.0)
        yield from (restarts, up)

    def _http_breaches(self) -> Metric:
        breaches = _family(
            "http_limit_breaches_total",
            "Connections of this process's HTTP ports closed for a limit, by port (admin, "
            "metrics) and limit (head_timeout: a request head not complete in time; "
            "body_timeout: a request body not complete in time; "
            "max_connections: evicted or refused at the connection cap).",
            ["port", "limit"],
        )
        for (port, limit), count in sorted(BREACHES.items()):
            breaches.add_metric([port, limit], count)
        return breaches


def render(collector: ControlPlaneCollector) -> bytes:
    """Prometheus text exposition of the control plane's metrics."""
    return generate_latest(collector)
