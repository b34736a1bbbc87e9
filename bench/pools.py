"""A fleet serving several models in the discrete-event simulation (:mod:`.des`).

:class:`PooledSimulation` is :class:`~bench.des.Simulation` with:

* instances that serve what ``serve`` says (a base model, then LoRA adapters; cycled over
  the instances), each simulated with its own served names, and declared in the fleet so
  the router's table has pools (:mod:`prefix_router.core.pools`);
* a model per conversation or shared prefix (``Arrival.group``), drawn once from ``mix``
  (model -> weight), so an application's requests keep their model, as they would;
* round robin and least request *within the pool* of the request's model (what Envoy
  does with a cluster per pool and no prefix key): the baseline a pooled router is held to;
* the fleet-LRU bound per pool: one LRU cache per model as large as its pool's instances
  together (blocks of two models never match: vLLM seeds them apart). Pools that share
  instances (an adapter and its base model) are each given the whole of those instances,
  so the sum over pools is above what the fleet can hold: a bound, not an estimate.

Routing for the prefix policies is the router's own code, unchanged: the table built
from the fleet picks the pool from the request's ``model``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence

from bench.bounds import BoundsTracker, CacheBounds, RequestHits
from bench.des import DesSettings, Simulation, _Engine, default_instance_url
from bench.policies import Policy
from bench.spec import Arrival, Message, Workload
from prefix_router.core.fleet import Instance
from vllm_sim.prefix_cache import BlockHash
from vllm_sim.server import serving


class PoolBounds(BoundsTracker):
    """A :class:`~bench.bounds.BoundsTracker` per model, fed the request of the model
    being sent; :meth:`result` is their token-weighted sum."""

    def __init__(self, capacity_blocks: Mapping[str, int]) -> None:
        super().__init__(capacity_blocks=sum(capacity_blocks.values()))
        self.trackers = {m: BoundsTracker(capacity_blocks=c) for m, c in capacity_blocks.items()}
        self.model = next(iter(self.trackers))

    def add(
        self, hashes: Sequence[BlockHash], *, prompt_tokens: int, total_tokens: int
    ) -> RequestHits:
        return self.trackers[self.model].add(
            hashes, prompt_tokens=prompt_tokens, total_tokens=total_tokens
        )

    def result(self) -> CacheBounds:
        parts = [t.result() for t in self.trackers.values()]
        queried = sum(p.queried_tokens for p in parts)
        return CacheBounds(
            infinite=sum(p.infinite * p.queried_tokens for p in parts) / max(1, queried),
            fleet_lru=sum(p.fleet_lru * p.queried_tokens for p in parts) / max(1, queried),
            queried_tokens=queried,
            capacity_blocks=sum(p.capacity_blocks for p in parts),
        )


class PooledSimulation(Simulation):
    def __init__(
        self,
        workload: Workload,
        settings: DesSettings,
        *,
        serve: Sequence[Sequence[str]],
        mix: Mapping[str, float],
    ) -> None:
        if settings.policy is Policy.CACHE_AWARE:
            raise ValueError("cache-aware routes over the whole fleet: no pools to compare")
        super().__init__(workload, settings)
        served = [tuple(s) for s in serve]
        self.serve = served
        names = [m for s in served for m in s]
        unserved = sorted(set(mix) - set(names))
        if unserved:
            raise ValueError(f"models nobody serves: {unserved}")
        # Requests are parsed as if one instance served every name; each engine keeps its own.
        self.config = serving(settings.engine, list(dict.fromkeys(names)))
        self.mix = dict(mix)
        self._model_rng = random.Random(f"pools:{settings.seed}")
        self._model_of: dict[str, str] = {}
        self._ids = (
            f"{default_instance_url(i)}#{','.join(served[i % len(served)])}"
            for i in itertools.count()
        )
        blocks = settings.engine.num_gpu_blocks
        counts = {
            m: sum(m in served[i % len(served)] for i in range(settings.instances))
            for m in self.mix
        }
        self._pool_bounds = PoolBounds({m: max(1, blocks * n) for m, n in counts.items()})
        self._bounds = self._pool_bounds
        self._rr_of: dict[str, int] = {}

    def _add_instances(self, count: int, now: float, ids: Sequence[str] = ()) -> None:
        for i in range(count):
            ident = ids[i] if i < len(ids) else next(self._ids)
            instance = Instance.from_url(ident)
            engine = _Engine(instance, serving(self.s.engine, instance.models), now)
            self._engines[instance.id] = engine
            self._active.append(engine)
        self._rebuild()

    def _send(self, arrival: Arrival, turn_index: int, history: tuple[Message, ...]) -> None:
        model = self._model_of.get(arrival.group)
        if model is None:
            names, weights = zip(*self.mix.items(), strict=True)
            model = self._model_of[arrival.group] = self._model_rng.choices(names, weights)[0]
        self.model = self._pool_bounds.model = model
        super()._send(arrival, turn_index, history)

    def _route(self, body: bytes, path: str) -> _Engine:
        engine = self._pick(body, path)
        if self.model not in engine.instance.models:  # what a live instance answers 404
            raise RuntimeError(f"a {self.model} request reached {engine.instance.id}")
        return engine

    def _pick(self, body: bytes, path: str) -> _Engine:
        policy = self.s.policy
        if policy.uses_router:
            return super()._route(body, path)
        pool = [e for e in self._active if self.model in e.instance.models]
        if policy is Policy.ROUND_ROBIN:
            turn = self._rr_of[self.model] = (self._rr_of.get(self.model, -1) + 1) % len(pool)
            return pool[turn]
        a, b = (pool[self._rng.randrange(len(pool))] for _ in range(2))
        return b if b.in_flight < a.in_flight else a
