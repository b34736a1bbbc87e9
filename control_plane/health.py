"""The control plane's own health probe, so ext_proc's ring mirror drops what Envoy drops.

Envoy's active health check (``model_cluster``) takes a failing instance out
of its ring, but ext_proc cannot see Envoy's verdict. So the control plane
probes each instance's health path too, with the same interval, timeout and
thresholds, and publishes the verdict as ``Instance.healthy`` in the shared
fleet: ext_proc then leaves the instance out of its mirror, and EDS marks it
``UNHEALTHY`` so Envoy agrees even between its own checks. The two verdicts
can differ for up to about one interval while an instance flips.

:func:`next_health` is the pure threshold rule (Envoy's: ``unhealthy_threshold``
failures in a row to go down, ``healthy_threshold`` successes to come back).
:func:`withhold_total_outage` keeps the last healthy instances up when every
probe fails at once: that is likelier the prober's side (a stalled host, a
network blip) than every instance at once, and Envoy, with no healthy host,
routes over all of them anyway (its panic threshold), so ext_proc's mirror
keeps keying them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from prefix_router.core.config import HealthCheckConfig
from prefix_router.core.fleet import Fleet, Instance, InstanceState
from prefix_router.state.store import FleetRecord, StateError, StateStore

log = logging.getLogger("prefix_router.control_plane.health")


@dataclass(slots=True)
class Streak:
    ok: bool
    count: int


def next_health(healthy: bool, streak: Streak, cfg: HealthCheckConfig) -> bool:
    """The verdict after a probe result was added to ``streak``."""
    if healthy and not streak.ok and streak.count >= cfg.unhealthy_threshold:
        return False
    if not healthy and streak.ok and streak.count >= cfg.healthy_threshold:
        return True
    return healthy


def withhold_total_outage(fleet: Fleet, flips: dict[str, bool]) -> dict[str, bool]:
    """``flips`` without its down-flips if applying them would leave no instance healthy
    while one is healthy now. Instances coming back are always let through."""
    active = [i for i in fleet.instances if i.state is InstanceState.ACTIVE]
    healthy_now = any(i.healthy for i in active)
    healthy_after = any(flips.get(i.id, i.healthy) for i in active)
    if healthy_now and not healthy_after:
        return {k: v for k, v in flips.items() if v}
    return flips


class HealthProber:
    def __init__(self, store: StateStore, *, client: httpx.AsyncClient | None = None) -> None:
        self.store = store
        self.client = client or httpx.AsyncClient()
        self.streaks: dict[str, Streak] = {}
        self.withholding = False
        """True while every probe fails and the last healthy instances are kept up."""

    async def probe(self, instance: Instance, cfg: HealthCheckConfig) -> bool:
        url = f"http://{instance.id}{cfg.path}"
        try:
            r = await self.client.get(url, timeout=cfg.timeout_ms / 1000)
            return 200 <= r.status_code < 300
        except (httpx.HTTPError, httpx.InvalidURL):  # unreachable, or no URL at all
            return False

    async def check_once(self) -> dict[str, bool]:
        """Probe every instance once; publish the flips. Returns {id: new verdict}."""
        state = await self.store.read()
        cfg = state.config.config.health_check
        fleet = state.fleet.fleet
        results = await asyncio.gather(*(self.probe(i, cfg) for i in fleet.instances))
        flips: dict[str, bool] = {}
        for instance, ok in zip(fleet.instances, results, strict=True):
            streak = self.streaks.get(instance.id)
            if streak is None or streak.ok != ok:
                streak = self.streaks[instance.id] = Streak(ok, 0)
            streak.count += 1
            verdict = next_health(instance.healthy, streak, cfg)
            if verdict != instance.healthy:
                flips[instance.id] = verdict
        for gone in set(self.streaks) - {i.id for i in fleet.instances}:
            del self.streaks[gone]
        kept = withhold_total_outage(fleet, flips)
        withheld = sorted(set(flips) - set(kept))
        if withheld and not self.withholding:  # once an episode, not every interval
            log.warning(
                "every instance failed its health check at once; keeping %s up "
                "(likelier this prober's side than the whole fleet)",
                ",".join(withheld),
            )
        self.withholding = bool(withheld)
        if kept:
            await self._publish(kept)
        return kept

    async def _publish(self, flips: dict[str, bool]) -> None:
        def change(record: FleetRecord) -> FleetRecord:
            instances = [
                i.with_changes(healthy=flips[i.id]) if i.id in flips else i
                for i in record.fleet.instances
            ]
            return FleetRecord(Fleet.of(instances, version=record.fleet.version), record.removing)

        def audit(before: FleetRecord, after: FleetRecord) -> dict[str, Any]:
            entry = {
                "actor": "health-check",
                "action": "set-health",
                "target": ",".join(sorted(flips)),
                "before": {k: not v for k, v in flips.items()},
                "after": flips,
                "fleet_version": after.fleet.version,
            }
            return entry

        await self.store.update_fleet(change, audit=audit)
        for instance_id, healthy in flips.items():
            log.warning("%s is now %s", instance_id, "healthy" if healthy else "unhealthy")

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            interval = 1.0
            try:
                await self.check_once()
                interval = (await self.store.read()).config.config.health_check.interval_ms / 1000
            except StateError as exc:
                log.warning("health sweep failed: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass

    async def close(self) -> None:
        await self.client.aclose()
