"""Draining: remove an instance only once nothing is in flight on it (or a timeout passes).

An instance being removed is first marked draining, which Envoy (EDS health
status ``DRAINING``) and ext_proc (``Instance.routable``) both honour, so it
gets no new requests while the ones in flight finish. :class:`Drainer` sweeps
the instances listed under ``removing`` and deletes one when
:func:`drain_verdict` says so:

* ``drained``: draining for at least ``grace_s`` (longer than xDS and Redis
  propagation, so no Envoy or ext_proc still routes new requests there) and
  its fleet-wide in-flight count is 0;
* ``timeout``: draining for ``timeout_s``, whatever is still in flight.

In-flight counts come from an :class:`InFlightSource`; the default reads the
load store's Redis hash ``<ns>inflight``. If it cannot answer, only the
timeout removes. Several control-plane replicas may sweep at once: the
removal is a compare-and-set on the fleet, so only one lands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from prefix_router.core.fleet import Fleet, Instance, InstanceState
from prefix_router.state.store import FleetRecord, StateError, StateStore

log = logging.getLogger("prefix_router.control_plane.drain")


class InFlightSource(Protocol):
    async def in_flight(self) -> dict[str, int]:
        """Fleet-wide in-flight count per instance id (absent means 0)."""
        ...


def drain_verdict(
    instance: Instance, in_flight: int | None, now: float, *, grace_s: float, timeout_s: float
) -> str | None:
    """``"drained"``, ``"timeout"`` or None (keep waiting). ``in_flight`` None: unknown."""
    if instance.state is not InstanceState.DRAINING:
        return None
    age = now - (instance.draining_since if instance.draining_since is not None else now)
    if age >= timeout_s:
        return "timeout"
    if age >= grace_s and in_flight is not None and in_flight <= 0:
        return "drained"
    return None


class Drainer:
    def __init__(
        self,
        store: StateStore,
        in_flight: InFlightSource,
        *,
        grace_s: float = 2.0,
        timeout_s: float = 300.0,
        interval_s: float = 0.25,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.in_flight = in_flight
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.clock = clock

    async def sweep(self) -> list[str]:
        """One pass: remove every instance whose drain is over. Returns their ids."""
        record = (await self.store.read()).fleet
        if not record.removing:
            return []
        try:
            counts: dict[str, int] | None = await self.in_flight.in_flight()
        except (StateError, OSError) as exc:
            log.warning("in-flight counts unavailable (%s): only the drain timeout removes", exc)
            counts = None
        now = self.clock()
        removed = []
        for instance_id in sorted(record.removing):
            instance = record.fleet.get(instance_id)
            count = None if counts is None else counts.get(instance_id, 0)
            verdict = (
                "gone"
                if instance is None
                else drain_verdict(
                    instance, count, now, grace_s=self.grace_s, timeout_s=self.timeout_s
                )
            )
            if verdict is not None and await self._remove(instance_id, verdict, count):
                removed.append(instance_id)
        return removed

    async def _remove(self, instance_id: str, verdict: str, in_flight: int | None) -> bool:
        def change(record: FleetRecord) -> FleetRecord:
            if instance_id not in record.removing:
                return record  # re-activated or removed meanwhile
            current = record.fleet.get(instance_id)
            if current is not None and current.state is not InstanceState.DRAINING:
                return record
            rest = [i for i in record.fleet.instances if i.id != instance_id]
            return FleetRecord(
                Fleet.of(rest, version=record.fleet.version), record.removing - {instance_id}
            )

        def audit(before: FleetRecord, after: FleetRecord) -> dict[str, Any]:
            old = before.fleet.get(instance_id)
            entry = {
                "actor": "drainer",
                "action": f"remove-instance ({verdict}, in flight {in_flight})",
                "target": instance_id,
                "before": old.to_json_dict() if old else None,
                "after": None,
                "fleet_version": after.fleet.version,
            }
            return entry

        before, after = await self.store.update_fleet(change, audit=audit)
        if after is before:
            return False
        if verdict == "timeout":
            log.warning("removed %s after the drain timeout, %s in flight", instance_id, in_flight)
        else:
            log.info("removed %s (%s)", instance_id, verdict)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep()
            except StateError as exc:
                log.warning("drain sweep failed: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass
