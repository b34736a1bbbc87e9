"""The routing state in this process: exact for a single ext_proc replica, not shared.

It serves one ext_proc replica without Redis, the degraded mode of every replica while
Redis is unavailable (decided on what this replica has seen), and the discrete-event
simulation, whose virtual clock it takes. Decisions are made by the one decision function
(:func:`prefix_router.core.decision.decide`) and applied at once.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from prefix_router.core.decision import release_writes
from prefix_router.core.index import CacheModel, InProcessIndex
from prefix_router.core.key import PrefixKey
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import InstanceModel, InstanceWork, Load, admit, finished
from prefix_router.state.routing.base import Routed

_IDLE = InstanceWork()


class InProcessStore:
    """Routing state kept in this process; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._index: InProcessIndex | None = None
        self._work: dict[str, InstanceWork] = {}
        self._models: dict[str, InstanceModel] = {}
        self._cache_models: dict[str, CacheModel] = {}
        """Each instance's cache model as of its last write (the index's view of it)."""
        self._in_flight: defaultdict[str, int] = defaultdict(int)
        self._table: RoutingTable | None = None
        """The latest request's table: what a release's index write is made on."""

    def learn(self, instance_id: str, model: InstanceModel) -> None:
        """Use ``model`` for the instance from now on (its metrics were read)."""
        self._models[instance_id] = model
        self._cache_models.pop(instance_id, None)

    def route_now(self, key: PrefixKey, table: RoutingTable) -> Routed:
        """:meth:`route`, synchronously (the simulation's event loop calls this)."""
        self._table = table
        index = self._index_for(table.rule.slots_log2)
        view = _View(self, table, self.clock())
        decision, ring_order = table.decide(key, view)
        for write in decision.index_writes:
            index.write(write)
        chosen = table.ids[decision.instance]
        self._work[chosen] = admit(
            self._work.get(chosen, _IDLE),
            view.now,
            prefill_tokens=decision.prefill_tokens,
            written_tokens=decision.written_tokens,
            rate=view.model(decision.instance).prefill_tokens_per_s,
            keep=table.rule.waiting_kept,
        )
        self._cache_models.pop(chosen, None)
        self._in_flight[chosen] += 1
        return Routed(decision, chosen, ring_order, self._work[chosen].busy_until)

    async def route(self, key: PrefixKey, table: RoutingTable, request_id: str = "") -> Routed:
        return self.route_now(key, table)

    def route_at_once(
        self, key: PrefixKey, table: RoutingTable, request_id: str = ""
    ) -> Routed | None:
        return self.route_now(key, table)

    def release(
        self, instance_id: str, prefill_end: float = 0.0, blocks: Sequence[int] = ()
    ) -> None:
        if self._in_flight.get(instance_id, 0) > 0:
            self._in_flight[instance_id] -= 1
            work = self._work.get(instance_id)
            if work is not None:
                self._work[instance_id] = finished(work, self.clock(), prefill_end)
            table = self._table
            instance = None if table is None else table.index_of.get(instance_id)
            if blocks and table is not None and instance is not None:
                slots_log2 = table.rule.slots_log2
                view = _View(self, table, self.clock())
                index = self._index_for(slots_log2)
                for write in release_writes(blocks, table.tags[instance], view, slots_log2):
                    index.write(write)

    def in_flight_now(self) -> dict[str, int]:
        return {k: v for k, v in self._in_flight.items() if v}

    async def in_flight(self) -> dict[str, int]:
        return self.in_flight_now()

    def work(self, instance_id: str) -> InstanceWork:
        return self._work.get(instance_id, _IDLE)

    async def close(self) -> None:
        self._in_flight.clear()

    def _index_for(self, slots_log2: int) -> InProcessIndex:
        if self._index is None or self._index.slots_log2 != slots_log2:
            self._index = InProcessIndex(slots_log2)
        return self._index


class _View:
    """The store's state as one decision reads it (a ``FleetView``)."""

    __slots__ = ("now", "_store", "_table", "_index")

    def __init__(self, store: InProcessStore, table: RoutingTable, now: float) -> None:
        self.now = now
        self._store = store
        self._table = table
        self._index = store._index_for(table.rule.slots_log2)

    def slot(self, slot: int) -> bytes:
        return self._index.read(slot)

    def work(self, instance: int) -> InstanceWork:
        return self._store._work.get(self._table.ids[instance], _IDLE)

    def model(self, instance: int) -> InstanceModel:
        return self._store._models.get(self._table.ids[instance], self._table.default_model)

    def load(self, instance: int) -> Load:
        store, name = self._store, self._table.ids[instance]
        model = store._models.get(name, self._table.default_model)
        return model.load(store._work.get(name, _IDLE), self.now, store._in_flight.get(name, 0))

    def total_in_flight(self) -> int:
        """Over the table's instances only, as the Redis store's view counts: requests
        still running on an instance that left the routable set (draining, unhealthy)
        must not raise the bound the routable ones are held to."""
        in_flight = self._store._in_flight
        return sum(in_flight.get(name, 0) for name in self._table.ids)

    def cache_model(self, tag: int) -> CacheModel | None:
        instance = self._table.instance_of_tag.get(tag)
        if instance is None:
            return None
        name = self._table.ids[instance]
        model = self._store._cache_models.get(name)
        if model is None:
            model = self._store._cache_models[name] = CacheModel.of(
                self.work(instance).written_tokens, self.model(instance).kv_cache_tokens
            )
        return model
