"""Discrete-event simulation of a routed fleet: the live stack's decisions, in virtual time.

Nothing here re-implements routing or the instance model. Each request's body is built by
:func:`~bench.spec.request_body` (the live driver's bytes), then:

* routed as the live stack routes it: ``round-robin`` / ``least-request`` as Envoy's
  load balancers do (least-request: the fewer in-flight of two random hosts);
  ``cache-aware`` as SGLang's model gateway would (:mod:`bench.cache_aware`, over each
  instance's requests in flight); ``prefix``
  and ``prefix-spill`` through ext_proc's code: :func:`prefix_router.core.key.extract_key`
  and the one decision function over an
  :class:`~prefix_router.state.routing.memory.InProcessStore` on the virtual clock (the
  prefix index, the prefill queues and the in-flight counts Redis would hold; a request
  counts from its routing decision to its last token), with the instance models learned
  from the engines' metrics each second as the control plane learns them;
* parsed and turned into an engine sequence by the simulator's own code
  (:func:`vllm_sim.protocol.parse_generation`, :func:`vllm_sim.engine.build_sequence`);
* served by the simulator's pure :class:`~vllm_sim.scheduler.Scheduler` (prefix cache,
  continuous batching, chunked prefill, preemption) stepped with its
  :class:`~vllm_sim.config.CostModel`, from a heap of events instead of asyncio sleeps.

A step runs exactly as the simulator's engine loop runs one (schedule, price, complete at
``start + duration``, step again while there is work), so TTFT, hit rates and in-flight
counts are what the live simulator would report, minus the HTTP, Envoy and ext_proc
overheads a live client also sees. Conversations send their next turn ``think_s`` after
the previous answer, resending the conversation with the generated answer.

Resizes add instances (empty caches) or remove random ones (they leave the ring at once
and finish what they hold, as a drained instance does); the table is rebuilt as ext_proc
rebuilds it, so only the keys of the instances that came or went move.

Cost: O(log events) per event plus the scheduler's O(running) per step; building a request
(JSON, tokenize, hash) dominates, ~0.5 ms for a 6k-token prompt.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from bench.bounds import BoundsTracker
from bench.cache_aware import CacheAwareRouter, routing_text
from bench.policies import Policy
from bench.results import InstanceStats, RequestRecord, RunResult
from bench.spec import PATHS, Arrival, Message, Workload, request_body
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.key import extract_key
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import InstanceModel, learned_prefill_rate, rates_by_group
from prefix_router.state.routing.memory import InProcessStore
from vllm_sim.config import EngineConfig
from vllm_sim.engine import build_sequence
from vllm_sim.errors import RequestError
from vllm_sim.protocol import parse_generation
from vllm_sim.scheduler import Scheduler, StepPlan
from vllm_sim.scheduler import Sequence as SimSequence
from vllm_sim.stats import EngineStats
from vllm_sim.tokenizer import detokenize_output

SCRAPE_S = 1.0
"""How often the control plane reads every instance's metrics."""
LEARN_WINDOW_S = 60.0
"""The window a prefill rate is learned over (the fleet view's window)."""


@dataclass(frozen=True, slots=True)
class Resize:
    at_s: float
    delta: int
    """Instances added (> 0) or removed (< 0)."""


def parse_resizes(text: str) -> tuple[Resize, ...]:
    """``"300:+16,600:-8"`` -> add 16 instances at 300 s, remove 8 at 600 s."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        at, _, delta = part.partition(":")
        try:
            out.append(Resize(float(at), int(delta)))
        except ValueError:
            raise ValueError(f"resize {part!r} is not TIME:+N or TIME:-N") from None
    return tuple(sorted(out, key=lambda r: r.at_s))


@dataclass(frozen=True, kw_only=True, slots=True)
class DesSettings:
    policy: Policy
    engine: EngineConfig
    router: RouterConfig
    instances: int = 4
    instance_ids: tuple[str, ...] = ()
    """``host:port[:weight[:hash_key]]`` of the initial instances. By default instance
    ``i`` has the ring identity (``hash_key``) ``vllm-i``, as the live benchmark's do, so
    both hash keys onto the same ring."""
    resizes: tuple[Resize, ...] = ()
    window_s: float = 30.0
    seed: int = 1


def default_instance_url(i: int) -> str:
    """Instance ``i`` of a fleet the simulation names itself, with ring identity ``vllm-i``."""
    return f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}:8000:1:vllm-{i}"


class _Engine:
    """One simulated instance: the simulator's scheduler plus the event loop's bookkeeping."""

    __slots__ = (
        "instance",
        "scheduler",
        "plan",
        "busy_s",
        "in_flight",
        "peak",
        "requests",
        "born_s",
        "gone_s",
        "readings",
    )

    def __init__(self, instance: Instance, config: EngineConfig, born_s: float) -> None:
        self.instance = instance
        self.scheduler = Scheduler(config, EngineStats())
        self.plan: StepPlan | None = None
        self.busy_s = 0.0
        self.in_flight = 0
        self.peak = 0
        self.requests = 0
        self.born_s = born_s
        self.gone_s: float | None = None
        self.readings: deque[tuple[float, int, int, float]] = deque()
        """Metrics read every second: (time, prompt tokens queried, hit, prefill seconds)."""


@dataclass(slots=True)
class _Pending:
    """A request inside an engine and what happens after it."""

    record: RequestRecord
    engine: _Engine
    arrival: Arrival
    turn: int
    history: tuple[Message, ...]
    prefill_end: float = 0.0
    """When the router modelled its prefill to end (given back with its release)."""
    blocks: tuple[int, ...] = ()
    """Its key's blocks (given back with its release, as ext_proc does)."""


@dataclass(frozen=True, slots=True)
class _Next:
    """A conversation's next turn, due after the previous answer and the think time."""

    arrival: Arrival
    turn: int
    history: tuple[Message, ...]


_STEP, _RESIZE, _SEND = 0, 1, 2


class Simulation:
    """One workload under one policy; :meth:`run` returns what the live driver would."""

    def __init__(self, workload: Workload, settings: DesSettings) -> None:
        self.workload = workload
        self.s = settings
        self.config = settings.engine
        self.model = settings.engine.model
        self._rng = random.Random(f"des:{settings.seed}")
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._engines: dict[str, _Engine] = {}
        self._active: list[_Engine] = []
        self._table: RoutingTable | None = None
        self._rr = 0
        self._fleet_version = 0
        self._ids = (default_instance_url(i) for i in itertools.count())
        self._pending: dict[str, _Pending] = {}
        self._records: list[RequestRecord] = []
        self._bounds = BoundsTracker(
            capacity_blocks=settings.engine.num_gpu_blocks * settings.instances
        )
        self._windows: dict[int, list[int]] = {}
        self._serial = itertools.count()
        self._events_log: list[tuple[float, str]] = []
        self.now = 0.0
        self._store = InProcessStore(clock=lambda: self.now)
        """The routing state ext_proc would keep (index, prefill queues), on the virtual clock."""
        self._next_scrape = 0.0
        self._prefill_end = 0.0
        self._blocks: tuple[int, ...] = ()
        self._cache_aware = CacheAwareRouter()

    # -- fleet --------------------------------------------------------------------------

    def _add_instances(self, count: int, now: float, ids: Sequence[str] = ()) -> None:
        for i in range(count):
            ident = ids[i] if i < len(ids) else next(self._ids)
            engine = _Engine(Instance.from_url(ident), self.config, now)
            self._engines[engine.instance.id] = engine
            self._active.append(engine)
        self._rebuild()

    def _remove_instances(self, count: int, now: float) -> None:
        count = min(count, len(self._active) - 1)
        for engine in self._rng.sample(self._active, count):
            self._active.remove(engine)
            engine.gone_s = now
            self._cache_aware.tree.forget(engine.instance.id)
        self._rebuild()

    def _rebuild(self) -> None:
        self._fleet_version += 1
        self._active.sort(key=lambda e: e.instance.id)
        if self.s.policy.uses_router:
            fleet = Fleet.of([e.instance for e in self._active], version=self._fleet_version)
            self._table = RoutingTable.build(fleet, self.s.policy.router_config(self.s.router))

    # -- routing ------------------------------------------------------------------------

    def _route(self, body: bytes, path: str) -> _Engine:
        policy, active = self.s.policy, self._active
        if policy is Policy.ROUND_ROBIN:
            self._rr = (self._rr + 1) % len(active)
            return active[self._rr]
        if policy is Policy.LEAST_REQUEST:
            a, b = (active[self._rng.randrange(len(active))] for _ in range(2))
            return b if b.in_flight < a.in_flight else a
        if policy is Policy.CACHE_AWARE:
            loads = {e.instance.id: e.in_flight for e in active}
            return self._engines[self._cache_aware.pick(routing_text(body), loads, self.now)]
        table = self._table
        assert table is not None
        if self.now >= self._next_scrape:
            self._learn(table)
        key = extract_key(body, settings=table.key_settings, path=path)
        routed = self._store.route_now(key, table)
        self._prefill_end = routed.prefill_end
        self._blocks = key.blocks
        return self._engines[routed.instance_id]

    def _learn(self, table: RoutingTable) -> None:
        """What the control plane learns from the instances' metrics every second: each
        one's KV cache size, and its prefill rate over the last minute, the median of its
        alike instances' (:func:`prefix_router.core.work.rates_by_group`, as
        :meth:`control_plane.fleet_view.FleetView.learned_models` computes it)."""
        self._next_scrape = self.now + SCRAPE_S
        learned: dict[str, float | None] = {}
        for engine in self._active:
            stats = engine.scheduler.stats
            readings = engine.readings
            readings.append(
                (
                    self.now,
                    stats.prefix_cache_queries,
                    stats.prefix_cache_hits,
                    stats.prefill_time.total,
                )
            )
            while len(readings) > 1 and readings[1][0] <= self.now - LEARN_WINDOW_S:
                readings.popleft()
            t0, q0, h0, p0 = readings[0]
            learned[engine.instance.id] = learned_prefill_rate(
                (stats.prefix_cache_queries - q0) - (stats.prefix_cache_hits - h0),
                stats.prefill_time.total - p0,
                self.now - t0,
            )
        rates = rates_by_group(
            learned, {e.instance.id: e.instance.base_models for e in self._active}
        )
        capacity = self.config.num_gpu_blocks * self.config.block_size
        default = table.default_model.prefill_tokens_per_s
        for engine in self._active:
            rate = rates[engine.instance.id] or default
            self._store.learn(engine.instance.id, InstanceModel(rate, capacity))

    # -- events -------------------------------------------------------------------------

    def _push(self, at: float, kind: int, data: object) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, data))

    def _send(self, arrival: Arrival, turn_index: int, history: tuple[Message, ...]) -> None:
        now = self.now
        turn = arrival.turns[turn_index]
        path = PATHS[turn.endpoint]
        body = request_body(turn, model=self.model, history=history)
        record = RequestRecord(arrival_s=now, instance=None, ttft_s=None, e2e_s=None)
        self._records.append(record)
        try:
            api = parse_generation(body, turn.endpoint, self.config)
            rid = f"r{next(self._serial)}"
            seq = build_sequence(self.config, api.params, request_id=rid, arrival_time=now)
        except RequestError as exc:
            record.error = f"400 {exc.message}"
            return
        engine = self._route(body, path)
        record.instance = engine.instance.id
        record.prompt_tokens = seq.prompt_len
        hits = self._bounds.add(
            seq.hashes, prompt_tokens=seq.prompt_len, total_tokens=len(seq.tokens)
        )
        record.ttft_floor_s = engine.scheduler.config.cost.step_seconds(
            prefill_tokens=seq.prompt_len - hits.infinite, decode_seqs=0, context_tokens=0
        )
        engine.in_flight += 1
        engine.peak = max(engine.peak, engine.in_flight)
        engine.requests += 1
        sent = (*history, *turn.messages)
        self._pending[rid] = _Pending(
            record, engine, arrival, turn_index, sent, self._prefill_end, self._blocks
        )
        engine.scheduler.add(seq)
        if engine.plan is None:
            self._step(engine, now)

    def _step(self, engine: _Engine, now: float) -> None:
        """Start the engine's next step at ``now`` if it has work (the engine loop's body)."""
        scheduler = engine.scheduler
        for _ in range(1000):
            if not scheduler.has_work:
                engine.plan = None
                return
            plan = scheduler.schedule(now)
            if not plan.empty:
                break
            if not plan.preempted:
                engine.plan = None  # nothing fits until a request arrives
                return
        else:
            raise RuntimeError("the scheduler keeps preempting without scheduling anything")
        duration = self.config.cost.step_seconds(
            prefill_tokens=plan.prefill_tokens,
            decode_seqs=plan.decode_seqs,
            context_tokens=plan.context_tokens,
        )
        engine.plan = plan
        engine.busy_s += duration
        self._push(now + duration, _STEP, engine)

    def _step_done(self, engine: _Engine) -> None:
        now, plan = self.now, engine.plan
        assert plan is not None
        outcome = engine.scheduler.complete(plan, now)
        for seq in outcome.progressed:
            if seq.num_output == 1:
                pending = self._pending[seq.request_id]
                pending.record.ttft_s = now - seq.arrival_time
        for seq in outcome.finished:
            self._finish(seq, now)
        self._step(engine, now)

    def _finish(self, seq: SimSequence, now: float) -> None:
        pending = self._pending.pop(seq.request_id)
        record = pending.record
        record.e2e_s = now - seq.arrival_time
        record.output_tokens = seq.num_output
        record.cached_tokens = seq.cached_tokens
        window = self._windows.setdefault(int(record.arrival_s // self.s.window_s), [0, 0])
        window[0] += seq.prompt_len
        window[1] += seq.cached_tokens or 0
        pending.engine.in_flight -= 1
        self._store.release(pending.engine.instance.id, pending.prefill_end, pending.blocks)
        arrival, nxt = pending.arrival, pending.turn + 1
        if nxt < len(arrival.turns):
            answer = detokenize_output(seq.tokens[seq.prompt_len : seq.prompt_len + seq.num_output])
            history = (*pending.history, ("assistant", answer))
            self._push(now + arrival.turns[nxt].think_s, _SEND, _Next(arrival, nxt, history))

    # -- run ----------------------------------------------------------------------------

    def run(self, progress: Callable[[int], None] | None = None) -> RunResult:
        self._add_instances(self.s.instances, 0.0, self.s.instance_ids)
        for resize in self.s.resizes:
            self._push(resize.at_s, _RESIZE, resize)
        arrivals: Iterator[Arrival] = iter(self.workload)
        upcoming = next(arrivals, None)
        done = 0
        while self._events or upcoming is not None:
            if upcoming is not None and (
                not self._events or upcoming.arrival_s <= self._events[0][0]
            ):
                self.now = upcoming.arrival_s
                self._send(upcoming, 0, ())
                upcoming = next(arrivals, None)
                continue
            at, _, kind, data = heapq.heappop(self._events)
            self.now = at
            if kind == _STEP:
                assert isinstance(data, _Engine)
                before = len(self._pending)
                self._step_done(data)
                if progress is not None and len(self._pending) < before:
                    done += before - len(self._pending)
                    progress(done)
            elif kind == _SEND:
                assert isinstance(data, _Next)
                self._send(data.arrival, data.turn, data.history)
            else:
                assert isinstance(data, Resize)
                self._resize(data)
        return self._result()

    def _resize(self, resize: Resize) -> None:
        if resize.delta > 0:
            self._add_instances(resize.delta, self.now)
        elif resize.delta < 0:
            self._remove_instances(-resize.delta, self.now)
        self._events_log.append((self.now, f"{resize.delta:+d} -> {len(self._active)} instances"))

    def _result(self) -> RunResult:
        end = self.now
        first = min((r.arrival_s for r in self._records), default=0.0)
        instances = []
        for engine in self._engines.values():
            stats = engine.scheduler.stats
            lifetime = (engine.gone_s if engine.gone_s is not None else end) - engine.born_s
            instances.append(
                InstanceStats(
                    id=engine.instance.id,
                    requests=engine.requests,
                    peak_in_flight=engine.peak,
                    busy=min(1.0, engine.busy_s / lifetime) if lifetime > 0 else None,
                    queries=stats.prefix_cache_queries,
                    hits=stats.prefix_cache_hits,
                    mean_ttft_s=stats.ttft.total / stats.ttft.count if stats.ttft.count else None,
                )
            )
        windows = [
            (k * self.s.window_s, hits / queries if queries else 0.0)
            for k, (queries, hits) in sorted(self._windows.items())
        ]
        return RunResult(
            mode="des",
            workload=self.workload.name,
            policy=self.s.policy.value,
            params="",
            records=self._records,
            instances=instances,
            duration_s=end - first,
            bounds=self._bounds.result(),
            windows=windows,
            events=self._events_log,
        )


def simulate(
    workload: Workload, settings: DesSettings, progress: Callable[[int], None] | None = None
) -> RunResult:
    """Run ``workload`` under ``settings`` in virtual time."""
    return Simulation(workload, settings).run(progress)
