"""Model discovery: which models each instance serves, learned from its ``GET /v1/models``.

vLLM lists there the base model it serves and every LoRA adapter loaded (an adapter with
its base model as ``parent``), adapters loaded or unloaded at runtime included. The
control plane asks every instance every ``interval`` seconds and publishes what changed
as ``Instance.discovered`` in the shared fleet, as the health probe publishes
``Instance.healthy``: ext_proc and the xDS snapshot then rebuild their pools
(:mod:`prefix_router.core.pools`) from the same fleet version.

Declared models (the fleet file, the admin API) always take precedence
(``Instance.serves``); what was discovered is still kept, so ``/status`` can say where
the two disagree (:func:`disagreements`). An instance that does not answer, or answers
something that is not a model list (not vLLM), keeps what was last discovered on it:
its health is the health probe's business, and forgetting its models would move it into
every pool.

:func:`parse_models` and :func:`disagreements` are pure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import httpx

from prefix_router.core.errors import FleetError
from prefix_router.core.fleet import Fleet, Instance, ServedModel, check_model_name
from prefix_router.core.pools import layout
from prefix_router.state.store import FleetRecord, StateError, StateStore

log = logging.getLogger("prefix_router.control_plane.models")

MODELS_PATH = "/v1/models"


def parse_models(payload: Any) -> tuple[ServedModel, ...] | None:
    """The models of a vLLM ``/v1/models`` answer, or None if it is not one. Names that
    could not be a pool (:func:`~prefix_router.core.fleet.check_model_name`) are left out."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return None
    found: dict[str, ServedModel] = {}
    for entry in payload["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            return None
        name, parent = entry["id"], entry.get("parent")
        try:
            check_model_name(name)
        except FleetError:
            continue
        found.setdefault(name, ServedModel(name, parent if isinstance(parent, str) else None))
    return tuple(found.values())


def disagreements(instances: Iterable[Instance]) -> list[dict[str, Any]]:
    """Instances whose declared models differ from what they were found serving: the
    declared ones route (``declared_only`` may be answered 404 by the instance), the
    ``discovered_only`` ones are not routed there."""
    out = []
    for instance in instances:
        if not instance.models or not instance.discovered:
            continue
        declared = set(instance.models)
        found = {m.name for m in instance.discovered}
        if declared != found:
            out.append(
                {
                    "instance": instance.id,
                    "declared_only": sorted(declared - found),
                    "discovered_only": sorted(found - declared),
                }
            )
    return out


def pools_doc(fleet: Fleet) -> dict[str, Any]:
    """The fleet's pools for ``/status`` and ``/fleet``: model -> instance ids (routable or
    not), the catch-all's, and where declared and discovered models disagree."""
    lay = layout(fleet.instances)
    return {
        "pooled": lay.pooled,
        "pools": {m: [i.id for i in members] for m, members in lay.by_model.items()},
        "catch_all": [i.id for i in lay.catch_all] if lay.pooled else [],
        "disagreements": disagreements(fleet.instances),
    }


class ModelDiscovery:
    """Asks every instance what it serves and publishes the changes (see the module doc)."""

    def __init__(
        self,
        store: StateStore,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 1.0,
        client: httpx.AsyncClient | None = None,
        api_key: str | None = None,
    ) -> None:
        """``api_key``: what the instances were started with (vLLM's ``--api-key``), which
        vLLM requires on every ``/v1`` path (not on ``/health`` or ``/metrics``)."""
        self.store = store
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.client = client or httpx.AsyncClient()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.refusals: dict[str, int] = {}
        """Per instance, the status of its last refusal, logged once until it changes."""

    async def ask(self, instance: Instance) -> tuple[ServedModel, ...] | None:
        try:
            r = await self.client.get(
                f"http://{instance.id}{MODELS_PATH}", timeout=self.timeout_s, headers=self.headers
            )
            if r.status_code != 200:
                self._refused(instance, r.status_code)
                return None
            self.refusals.pop(instance.id, None)
            return parse_models(r.json())
        except (httpx.HTTPError, httpx.InvalidURL, ValueError):
            return None

    def _refused(self, instance: Instance, status: int) -> None:
        if self.refusals.get(instance.id) == status:
            return
        self.refusals[instance.id] = status
        hint = (
            ": give the control plane the instances' API key (--instance-api-key-file or "
            "VLLM_API_KEY)"
            if status in (401, 403)
            else ""
        )
        log.warning("%s answered %d to GET %s%s", instance.id, status, MODELS_PATH, hint)

    async def discover_once(self) -> dict[str, tuple[ServedModel, ...]]:
        """Ask every instance once; publish what changed. Returns {id: now discovered}."""
        fleet = (await self.store.read()).fleet.fleet
        answers = await asyncio.gather(*(self.ask(i) for i in fleet.instances))
        changed = {
            instance.id: found
            for instance, found in zip(fleet.instances, answers, strict=True)
            if found is not None and found != instance.discovered
        }
        if changed:
            await self._publish(changed)
        return changed

    async def _publish(self, changed: dict[str, tuple[ServedModel, ...]]) -> None:
        before: dict[str, list[str]] = {}

        def change(record: FleetRecord) -> FleetRecord:
            instances = []
            for i in record.fleet.instances:
                if i.id in changed:
                    before[i.id] = [m.name for m in i.discovered]
                    i = i.with_changes(discovered=changed[i.id])
                instances.append(i)
            return FleetRecord(Fleet.of(instances, version=record.fleet.version), record.removing)

        def audit(_: FleetRecord, after: FleetRecord) -> dict[str, Any]:
            entry = {
                "actor": "model-discovery",
                "action": "set-discovered-models",
                "target": ",".join(sorted(changed)),
                "before": before,
                "after": {k: [m.name for m in v] for k, v in changed.items()},
                "fleet_version": after.fleet.version,
            }
            return entry

        await self.store.update_fleet(change, audit=audit)
        for instance_id, found in changed.items():
            log.info("%s serves %s", instance_id, ", ".join(m.name for m in found) or "nothing")

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.discover_once()
            except StateError as exc:
                log.warning("model discovery failed: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def close(self) -> None:
        await self.client.aclose()
