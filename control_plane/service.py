"""The admin operations: config and fleet changes, each validated, atomic and audited.

This is the service layer under the admin API's thin routes. Every change is
a pure function of the current document applied by
:meth:`~prefix_router.state.store.StateStore.update_fleet` /
:meth:`~prefix_router.state.store.StateStore.update_config`: it either raises
(:class:`~prefix_router.core.errors.ConfigError`, :class:`~prefix_router.core.errors.FleetError`;
nothing is written) or lands together with its audit entry (what, before,
after, when, who).

Removing an instance never cuts traffic: it marks the instance draining (no
new requests from Envoy or ext_proc) and lists it under ``removing``; the
:class:`~control_plane.drain.Drainer` deletes it once its in-flight count is 0
or the drain timeout passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from control_plane.callbacks import ClientRegistry
from control_plane.drain import InFlightSource
from control_plane.fleet_view import FleetView
from control_plane.metrics import ControlPlaneCollector, render
from control_plane.models import pools_doc
from prefix_router.core.config import RouterConfig, parse_config
from prefix_router.core.errors import FleetError
from prefix_router.core.fleet import Fleet, Instance, InstanceState
from prefix_router.state.store import ConfigRecord, FleetRecord, StateError, StateStore

UPDATABLE = frozenset({"weight", "models", "hash_key", "state"})


class InstanceNotFound(FleetError):
    """No instance has this id."""


class InstanceExists(FleetError):
    """An instance with this id is already in the fleet."""


class RingKeyTaken(InstanceExists):
    """Another instance already has this ring key (its ``hash_key``, or its id)."""


def _ring_key_free(record: FleetRecord, instance: Instance) -> None:
    """``instance``'s ring key is no other active instance's (a collision between two
    others, written before this check, blocks nothing unrelated)."""
    if instance.state is not InstanceState.ACTIVE:
        return
    for other in record.fleet.instances:
        if (
            other.id != instance.id
            and other.state is InstanceState.ACTIVE
            and other.ring_key == instance.ring_key
        ):
            raise RingKeyTaken(
                f"instances {other.id!r} and {instance.id!r} would have the same ring key "
                f"{instance.ring_key!r}: give each its own hash_key"
            )


def _fleet_audit(
    actor: str, action: str, target: str
) -> Callable[[FleetRecord, FleetRecord], dict[str, Any]]:
    def entry(before: FleetRecord, after: FleetRecord) -> dict[str, Any]:
        old, new = before.fleet.get(target), after.fleet.get(target)
        record = {
            "actor": actor,
            "action": action,
            "target": target,
            "before": old.to_json_dict() if old else None,
            "after": new.to_json_dict() if new else None,
            "fleet_version": after.fleet.version,
        }
        return record

    return entry


def _config_audit(
    actor: str, action: str
) -> Callable[[ConfigRecord, ConfigRecord], dict[str, Any]]:
    def entry(before: ConfigRecord, after: ConfigRecord) -> dict[str, Any]:
        old, new = before.config.to_json_dict(), after.config.to_json_dict()
        record = {
            "actor": actor,
            "action": action,
            "target": "config",
            "before": {k: v for k, v in old.items() if new.get(k) != v},
            "after": {k: v for k, v in new.items() if old.get(k) != v},
            "config_version": after.version,
        }
        return record

    return entry


def _replace(record: FleetRecord, instance: Instance, removing: frozenset[str]) -> FleetRecord:
    others = [i for i in record.fleet.instances if i.id != instance.id]
    return FleetRecord(Fleet.of([*others, instance], version=record.fleet.version), removing)


def _existing(record: FleetRecord, instance_id: str) -> Instance:
    instance = record.fleet.get(instance_id)
    if instance is None:
        raise InstanceNotFound(f"no instance {instance_id!r}")
    return instance


class AdminService:
    def __init__(
        self,
        store: StateStore,
        in_flight: InFlightSource,
        *,
        clients: ClientRegistry | None = None,
        published_version: Callable[[], str | None] = lambda: None,
        clock: Callable[[], float] = time.time,
        view: FleetView | None = None,
    ) -> None:
        self.store = store
        self.in_flight_source = in_flight
        self.clients = clients
        self.published_version = published_version
        self.clock = clock
        self.view = view or FleetView(store)
        self.collector = ControlPlaneCollector(
            self.view, clients or ClientRegistry(), published_version
        )

    # -- config ---------------------------------------------------------------

    async def get_config(self) -> ConfigRecord:
        return (await self.store.read()).config

    async def put_config(self, body: Any, *, actor: str) -> ConfigRecord:
        config = parse_config(body)
        _, after = await self.store.update_config(
            lambda _: config, audit=_config_audit(actor, "put-config")
        )
        return after

    async def patch_config(self, changes: dict[str, Any], *, actor: str) -> ConfigRecord:
        def change(current: RouterConfig) -> RouterConfig:
            return current.patched(changes)

        _, after = await self.store.update_config(
            change, audit=_config_audit(actor, "patch-config")
        )
        return after

    # -- instances ------------------------------------------------------------

    async def list_instances(self) -> FleetRecord:
        return (await self.store.read()).fleet

    async def get_instance(self, instance_id: str) -> Instance:
        return _existing((await self.store.read()).fleet, instance_id)

    async def add_instance(self, instance: Instance, *, actor: str) -> tuple[Instance, int]:
        def change(record: FleetRecord) -> FleetRecord:
            if record.fleet.get(instance.id) is not None:
                raise InstanceExists(f"instance {instance.id!r} already exists")
            _ring_key_free(record, instance)
            return _replace(record, instance, record.removing)

        _, after = await self.store.update_fleet(
            change, audit=_fleet_audit(actor, "add-instance", instance.id)
        )
        return _existing(after, instance.id), after.fleet.version

    async def update_instance(
        self, instance_id: str, changes: dict[str, Any], *, actor: str
    ) -> tuple[Instance, int]:
        unknown = set(changes) - UPDATABLE
        if unknown:
            raise FleetError(f"cannot update {sorted(unknown)}; updatable: {sorted(UPDATABLE)}")

        def change(record: FleetRecord) -> FleetRecord:
            current = _existing(record, instance_id)
            fields = dict(changes)
            if "models" in fields:
                fields["models"] = tuple(fields["models"])
            removing = record.removing
            if "state" in fields:
                state = InstanceState(fields["state"])
                fields["state"] = state
                if state is InstanceState.ACTIVE:
                    fields["draining_since"] = None
                    removing = removing - {instance_id}
                elif current.state is not InstanceState.DRAINING:
                    fields["draining_since"] = self.clock()
            changed = current.with_changes(**fields)
            if changed.ring_key != current.ring_key or changed.state is not current.state:
                _ring_key_free(record, changed)
            return _replace(record, changed, removing)

        _, after = await self.store.update_fleet(
            change, audit=_fleet_audit(actor, "update-instance", instance_id)
        )
        return _existing(after, instance_id), after.fleet.version

    async def drain_instance(
        self, instance_id: str, *, actor: str, remove: bool = False
    ) -> tuple[Instance, int]:
        """Mark draining (kept in the fleet), or with ``remove`` delete it once drained."""

        def change(record: FleetRecord) -> FleetRecord:
            current = _existing(record, instance_id)
            if current.state is not InstanceState.DRAINING:
                current = current.with_changes(
                    state=InstanceState.DRAINING, draining_since=self.clock()
                )
            removing = record.removing | {instance_id} if remove else record.removing
            return _replace(record, current, removing)

        action = "remove-instance" if remove else "drain-instance"
        _, after = await self.store.update_fleet(
            change, audit=_fleet_audit(actor, action, instance_id)
        )
        return _existing(after, instance_id), after.fleet.version

    # -- status ---------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        state = await self.store.read()
        in_flight: dict[str, int] | None
        try:
            in_flight = await self.in_flight_source.in_flight()
        except (StateError, OSError):
            in_flight = None
        instances = []
        for inst in state.fleet.fleet.instances:
            doc = inst.to_json_dict()
            doc["routable"] = inst.routable
            doc["removing"] = inst.id in state.fleet.removing
            doc["in_flight"] = None if in_flight is None else in_flight.get(inst.id, 0)
            instances.append(doc)
        return {
            "fleet_version": state.fleet.fleet.version,
            "config_version": state.config.version,
            "published_snapshot": self.published_version(),
            "instances": instances,
            "models": pools_doc(state.fleet.fleet),
            "xds_clients": self.clients.to_json_list() if self.clients else [],
        }

    async def audit(self, limit: int) -> list[dict[str, Any]]:
        return await self.store.audit_log(limit)

    # -- observability --------------------------------------------------------

    async def fleet(self) -> dict[str, Any]:
        """The fleet view (status page): state and loads read now, vLLM figures from the
        last scrape round."""
        await self.view.refresh()
        doc = self.view.snapshot().to_json_dict()
        doc["published_snapshot"] = self.published_version()
        state = self.view.state
        doc["models"] = pools_doc(state.fleet.fleet) if state is not None else None
        doc["xds_clients"] = self.clients.to_json_list() if self.clients else []
        return doc

    async def metrics(self) -> bytes:
        """Prometheus text of the control plane's metrics, state and loads read now."""
        await self.view.refresh()
        return render(self.collector)
