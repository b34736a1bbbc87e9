"""Capacity at a TTFT objective: the highest offered rate a fleet serves within it, and the
smallest fleet that serves a given rate.

Every other benchmark offers a fixed rate, so each policy's throughput equals the offered
rate; what an operator buys a router for is how much traffic the same fleet serves within
its latency objective (or how few instances serve the same traffic). This module answers
both with the discrete-event simulation (:mod:`bench.des`).

**One probe** runs a workload at one offered rate, fleet size and seed (the workload's seed
and the simulation's), and measures the requests that arrive in a *window*: after a warm-up
(the first ``warmup`` of the span in which new arrivals come; caches start empty) and before
the last new arrival (after it a multi-turn workload's load drains away). The probe passes
when, in the window, P50 and P99 TTFT are within the :class:`Objective` and the whole run
had no more errors than allowed.

**The seed rule**: a rate (or fleet size) passes only when every seed passes. The searches
screen with one seed (one run per step) and confirm their answer with all the others at the
knee; a confirmation that fails moves the answer down (rate) or up (fleet), the seed that
failed leads the screening, and the search goes on, so the answer always passed on every
seed and the bracket's other end failed on at least one.

**The rate search** (:func:`search_rate`) brackets geometrically from a start (x ``factor``
up while passing, / ``factor`` down while failing), then bisects on the geometric mean
until ``hi / lo <= 1 + precision``; the capacity is ``lo`` and lies in ``[lo, hi)``. The
runs are bounded: ``log(max/min) / log(factor)`` to bracket, ``log2(log(factor) /
log(1 + precision))`` per bisection. **The fleet search** (:func:`search_fleet`) finds the
smallest integer fleet in ``[lo, hi]`` that passes, galloping from a guess and then
bisecting. Both are pure functions of a ``passes(x, seed)`` callback, table-tested.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from bench.des import DesSettings, simulate
from bench.policies import ALL_POLICIES, Policy
from bench.policies import parse_policies as _parse
from bench.results import RequestRecord, RunResult, percentile
from bench.spec import Arrival, Workload
from bench.workloads import Common, describe, generate
from prefix_router.core.config import RouterConfig
from vllm_sim.config import EngineConfig

# -- the objective ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Objective:
    """What "serves the traffic" means: TTFT percentiles in the window, errors, and keeping
    up with the offered rate."""

    p50_s: float = 0.5
    p99_s: float = 2.0
    max_errors: int = 0
    min_served: float = 0.9
    """Requests completed in the window per second, at least this fraction of the offered
    rate: the fleet keeps up. Without it a fleet whose decoding falls behind passes on
    TTFT alone (the scheduler starts new prefills while every sequence's decode slows, so
    in-flight requests pile up and nothing shows in TTFT during a run), and a multi-turn
    workload hides its own overload: the next turn waits for the last answer, so a slow
    fleet is sent fewer turns than offered (chat at 342 turns/s sent 131/s into round
    robin's window and still met the TTFT bounds). 0: not checked (results saved before
    the check)."""
    max_tpot_s: float = 0.0
    """Median time per output token of the requests that arrived in the window's first
    half at most this many seconds (0: not checked): the decode speed users see. A fleet
    past its capacity rarely shows it in TTFT (the scheduler admits new prompts while
    every sequence's decode slows). The first half, because the second half's answers
    finish while arrivals stop at the end of the run, with every step faster."""

    def __str__(self) -> str:
        served = f", completed >= {self.min_served:.0%} of offered" if self.min_served else ""
        tpot = f", P50 TPOT <= {self.max_tpot_s * 1000:g} ms" if self.max_tpot_s else ""
        return (
            f"P50 TTFT <= {self.p50_s:g} s, P99 TTFT <= {self.p99_s:g} s, "
            f"errors <= {self.max_errors}{served}{tpot}"
        )


@dataclass(frozen=True, slots=True)
class Probe:
    """One run's figures over its measurement window."""

    rate: float
    instances: int
    seed: int
    passed: bool
    requests: int
    """Requests that arrived in the window."""
    errors: int
    """Errors over the whole run."""
    p50_s: float
    p99_s: float
    window_s: float
    good: int
    """Requests in the window that completed without error with TTFT <= the P99 bound:
    the requests that met the objective, one by one."""
    good_output_tokens: int
    hit_rate: float
    cpu_s: float = 0.0
    completed: int | None = None
    """Requests that completed in the window, whenever they arrived (None: not measured,
    results saved before it was)."""
    tpot_p50_s: float | None = None
    """Median time per output token over the window's first half (None: not measured)."""

    @property
    def served_fraction(self) -> float | None:
        """Completions per second in the window over the offered rate."""
        if self.completed is None or self.window_s <= 0 or self.rate <= 0:
            return None
        return self.completed / self.window_s / self.rate

    @property
    def goodput_rps(self) -> float:
        return self.good / self.window_s if self.window_s > 0 else 0.0

    @property
    def goodput_tps(self) -> float:
        """Output tokens per second of the requests that met the objective."""
        return self.good_output_tokens / self.window_s if self.window_s > 0 else 0.0


def measure(
    result: RunResult,
    window: tuple[float, float],
    objective: Objective,
    *,
    rate: float,
    instances: int,
    seed: int,
) -> Probe:
    """The figures of ``result`` over the requests that arrived in ``window``."""
    start, end = window
    inside = [r for r in result.records if start <= r.arrival_s <= end]
    ttfts = sorted(
        r.ttft_s if r.error is None and r.ttft_s is not None else math.inf for r in inside
    )
    good = [
        r
        for r in inside
        if r.error is None and r.ttft_s is not None and r.ttft_s <= objective.p99_s
    ]
    completed = sum(
        1
        for r in result.records
        if r.error is None and r.e2e_s is not None and start <= r.arrival_s + r.e2e_s <= end
    )
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    errors = result.errors
    tpot = tpot_p50(r for r in inside if r.arrival_s < (start + end) / 2)
    passed = (
        bool(inside)
        and p50 <= objective.p50_s
        and p99 <= objective.p99_s
        and errors <= objective.max_errors
        and completed >= objective.min_served * rate * (end - start)
        and (not objective.max_tpot_s or (tpot is not None and tpot <= objective.max_tpot_s))
    )
    return Probe(
        rate=rate,
        instances=instances,
        seed=seed,
        passed=passed,
        requests=len(inside),
        errors=errors,
        p50_s=p50,
        p99_s=p99,
        window_s=end - start,
        good=len(good),
        good_output_tokens=sum(r.output_tokens for r in good),
        hit_rate=result.hit_rate,
        completed=completed,
        tpot_p50_s=tpot,
    )


def tpot_p50(records: Iterable[RequestRecord]) -> float | None:
    """Median time per output token after the first of the answered ``records`` with more
    than one output token; None when there are none."""
    per_token = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in records
        if r.error is None and r.ttft_s is not None and r.e2e_s is not None and r.output_tokens > 1
    ]
    return statistics.median(per_token) if per_token else None


# -- the searches (pure) ----------------------------------------------------------------------

Passes = Callable[[float, int], bool]
"""``passes(x, seed)``: does one run at rate (or fleet size) ``x`` with ``seed`` pass?"""


class _Runs:
    """The seed rule over a ``passes`` callback, each ``(x, seed)`` run at most once.

    Screening runs one seed: the first, then whichever last failed a confirmation (the
    seed whose knee is lowest so far), so one optimistic seed does not lead the search up
    to rates the others fail, again and again."""

    def __init__(self, passes: Passes, seeds: Sequence[int]) -> None:
        if not seeds:
            raise ValueError("need at least one seed")
        self._passes = passes
        self.seeds = tuple(seeds)
        self.lead = self.seeds[0]
        self.log: list[tuple[float, int, bool]] = []
        self._known: dict[tuple[float, int], bool] = {}

    def run(self, x: float, seed: int) -> bool:
        if (x, seed) not in self._known:
            verdict = bool(self._passes(x, seed))
            self._known[(x, seed)] = verdict
            self.log.append((x, seed, verdict))
        return self._known[(x, seed)]

    def screen(self, x: float) -> bool:
        """The lead seed's verdict; a fail is final under the seed rule, a pass is not."""
        return self.run(x, self.lead)

    def confirm(self, x: float) -> bool:
        """Every seed passes (the lead first; stops at the first that fails, which leads
        the screening from then on)."""
        for seed in (self.lead, *(s for s in self.seeds if s != self.lead)):
            if not self.run(x, seed):
                self.lead = seed
                return False
        return True


@dataclass(frozen=True, slots=True)
class RateSearch:
    """The highest rate that passed on every seed (``lo``) and the lowest above it that
    failed on one (``hi``). ``lo`` is None when even ``min_rate`` failed, ``hi`` when
    ``max_rate`` passed."""

    lo: float | None
    hi: float | None
    runs: tuple[tuple[float, int, bool], ...]

    @property
    def precision(self) -> float | None:
        """``hi / lo - 1``: the capacity lies in ``[lo, lo x (1 + precision))``."""
        return self.hi / self.lo - 1 if self.lo and self.hi else None


def _round(x: float) -> float:
    """Four significant digits: rates that read well in a command line."""
    return float(f"{x:.4g}")


def _ascend(
    test: Callable[[float], bool], passing: float, factor: float, max_rate: float
) -> tuple[float, float | None]:
    """Up by ``factor`` from a passing rate until one fails: ``(lo, hi)``."""
    lo = passing
    while lo < max_rate:
        x = min(_round(lo * factor), max_rate)
        if not test(x):
            return lo, x
        lo = x
    return lo, None


def _descend(
    test: Callable[[float], bool], failing: float, factor: float, min_rate: float
) -> tuple[float | None, float]:
    """Down by ``factor`` from a failing rate until one passes: ``(lo, hi)``."""
    hi = failing
    while hi > min_rate:
        x = max(_round(hi / factor), min_rate)
        if test(x):
            return x, hi
        hi = x
    return None, hi


def _bisect(
    test: Callable[[float], bool], lo: float, hi: float, precision: float
) -> tuple[float, float]:
    while hi / lo > 1 + precision:
        mid = _round(math.sqrt(lo * hi))
        if not lo < mid < hi:
            break  # rounding has nothing left between them
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def search_rate(
    passes: Passes,
    *,
    start: float,
    seeds: Sequence[int] = (1, 2, 3),
    factor: float = 1.4,
    precision: float = 0.05,
    min_rate: float = 0.05,
    max_rate: float = 10_000.0,
) -> RateSearch:
    """The highest rate at which every seed passes, to ``precision`` (module docstring)."""
    if factor < 1.01 or precision <= 0 or not 0 < min_rate <= max_rate:
        raise ValueError("need factor >= 1.01, precision > 0 and 0 < min_rate <= max_rate")
    runs = _Runs(passes, seeds)
    x = min(max(_round(start), min_rate), max_rate)
    lo: float | None
    hi: float | None
    if runs.screen(x):
        lo, hi = _ascend(runs.screen, x, factor, max_rate)
    else:
        lo, hi = _descend(runs.screen, x, factor, min_rate)
    test, failures = runs.screen, 0
    while lo is not None:
        if hi is not None:
            lo, hi = _bisect(test, lo, hi, precision)
        if runs.confirm(lo):
            break
        # Failed on another seed: the knee is below; bracket and bisect again under it,
        # screening with that seed (after a second such miss, with every seed: bounded).
        failures += 1
        test = runs.screen if failures < 2 else runs.confirm
        lo, hi = _descend(test, lo, factor, min_rate)
    return RateSearch(lo=lo, hi=hi, runs=tuple(runs.log))


@dataclass(frozen=True, slots=True)
class FleetSearch:
    """The smallest fleet that passed on every seed (None: not even the largest)."""

    instances: int | None
    runs: tuple[tuple[float, int, bool], ...]


def _first_passing(test: Callable[[int], bool], lo: int, hi: int, guess: int) -> int | None:
    """The smallest ``n`` in ``[lo, hi]`` with ``test(n)``, for a ``test`` that fails below
    some ``n`` and passes from it on: gallop from ``guess``, then bisect."""
    if lo > hi:
        return None
    n = min(max(guess, lo), hi)
    step = 1
    if test(n):  # gallop down to a fail (or lo)
        passing, failing = n, lo - 1
        while passing > lo:
            m = max(passing - step, lo)
            if not test(m):
                failing = m
                break
            passing, step = m, step * 2
    else:  # gallop up to a pass (or past hi)
        failing = n
        passing = hi + 1
        while failing < hi:
            m = min(failing + step, hi)
            if test(m):
                passing = m
                break
            failing, step = m, step * 2
        if passing > hi:
            return None
    while passing - failing > 1:
        mid = (passing + failing) // 2
        if test(mid):
            passing = mid
        else:
            failing = mid
    return passing


def search_fleet(
    passes: Passes, *, guess: int, lo: int = 4, hi: int = 64, seeds: Sequence[int] = (1, 2, 3)
) -> FleetSearch:
    """The smallest fleet in ``[lo, hi]`` at which every seed passes (module docstring)."""
    if not 1 <= lo <= hi:
        raise ValueError("need 1 <= lo <= hi")
    runs = _Runs(passes, seeds)
    while True:
        n = _first_passing(lambda k: runs.screen(k), lo, hi, guess)
        if n is None or runs.confirm(n):
            return FleetSearch(instances=n, runs=tuple(runs.log))
        lo = guess = n + 1  # failed on another seed (now the lead): a larger fleet is needed


# -- running probes in the simulation ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    """How long each probe runs and what it measures."""

    requests: int = 2000
    """At least this many requests per run..."""
    min_duration_s: float = 0.0
    """...and at least this many model seconds of new arrivals (``rate x`` this many
    requests): multi-turn conversations need the run to be several lifetimes long."""
    warmup: float = 0.25
    """Fraction of the span of new arrivals not measured (caches start empty)."""

    def requests_at(self, rate: float) -> int:
        return max(self.requests, math.ceil(rate * self.min_duration_s))


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeSetup:
    """Everything a probe needs besides its rate, fleet size and seed (picklable)."""

    workload: str
    overrides: tuple[tuple[str, str | int | float], ...] = ()
    policy: Policy
    engine: EngineConfig
    router: RouterConfig
    plan: RunPlan = field(default_factory=RunPlan)
    objective: Objective = field(default_factory=Objective)


class LastArrival:
    """Passes a workload's arrivals through and remembers the last one's time."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.at = 0.0

    def _make(self) -> Iterator[Arrival]:
        for arrival in self.workload:
            self.at = arrival.arrival_s
            yield arrival

    def tapped(self) -> Workload:
        return Workload(self.workload.name, self.workload.num_requests, self._make)


def run_probe(setup: ProbeSetup, rate: float, instances: int, seed: int) -> Probe:
    """One simulated run of ``setup`` at ``rate`` on ``instances`` with ``seed``."""
    overrides = dict(setup.overrides) | {
        "rate": rate,
        "requests": setup.plan.requests_at(rate),
        "seed": seed,
    }
    tap = LastArrival(generate(setup.workload, overrides))
    settings = DesSettings(
        policy=setup.policy,
        engine=setup.engine,
        router=setup.router,
        instances=instances,
        seed=seed,
    )
    began = time.process_time()
    result = simulate(tap.tapped(), settings)
    probe = measure(
        result,
        (setup.plan.warmup * tap.at, tap.at),
        setup.objective,
        rate=rate,
        instances=instances,
        seed=seed,
    )
    return _with_cpu(probe, time.process_time() - began)


def _with_cpu(probe: Probe, cpu_s: float) -> Probe:
    return Probe(**(asdict(probe) | {"cpu_s": cpu_s}))


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSettings:
    start: float
    seeds: tuple[int, ...] = (1, 2, 3)
    factor: float = 1.4
    precision: float = 0.05
    min_rate: float = 0.05
    max_rate: float = 10_000.0


@dataclass(slots=True)
class Capacity:
    """A policy's capacity on one workload, with every probe the search ran."""

    policy: str
    instances: int
    search: RateSearch
    probes: list[Probe]

    @property
    def knee(self) -> list[Probe]:
        """The probes at the capacity (every seed)."""
        return [p for p in self.probes if p.rate == self.search.lo]


def _log(setup: ProbeSetup, probe: Probe) -> None:
    print(
        f"  {setup.workload} {setup.policy.value}: {probe.rate:g} req/s on "
        f"{probe.instances}, seed {probe.seed}: P50 {probe.p50_s * 1000:,.0f} ms, P99 "
        f"{probe.p99_s * 1000:,.0f} ms, errors {probe.errors}, hit rate "
        f"{probe.hit_rate:.0%}, completed {probe.served_fraction or 0:.0%} of offered"
        + ("" if probe.tpot_p50_s is None else f", P50 TPOT {probe.tpot_p50_s * 1000:.0f} ms")
        + " -> "
        f"{'pass' if probe.passed else 'FAIL'} "
        f"({probe.cpu_s:.1f} CPU s)",
        file=sys.stderr,
        flush=True,
    )


def find_capacity(
    setup: ProbeSetup, instances: int, search: SearchSettings, verbose: bool = False
) -> Capacity:
    """The highest rate ``setup`` serves on ``instances`` within its objective."""
    probes: list[Probe] = []

    def passes(rate: float, seed: int) -> bool:
        probe = run_probe(setup, rate, instances, seed)
        probes.append(probe)
        if verbose:
            _log(setup, probe)
        return probe.passed

    found = search_rate(
        passes,
        start=search.start,
        seeds=search.seeds,
        factor=search.factor,
        precision=search.precision,
        min_rate=search.min_rate,
        max_rate=search.max_rate,
    )
    return Capacity(policy=setup.policy.value, instances=instances, search=found, probes=probes)


@dataclass(slots=True)
class FleetNeed:
    """The smallest fleet that serves ``rate`` under a policy, with every probe."""

    policy: str
    rate: float
    search: FleetSearch
    probes: list[Probe]


def find_fleet(
    setup: ProbeSetup,
    rate: float,
    *,
    guess: int,
    lo: int,
    hi: int,
    seeds: Sequence[int],
    verbose: bool = False,
) -> FleetNeed:
    """The smallest fleet in ``[lo, hi]`` that serves ``rate`` within the objective."""
    probes: list[Probe] = []

    def passes(instances: float, seed: int) -> bool:
        probe = run_probe(setup, rate, int(instances), seed)
        probes.append(probe)
        if verbose:
            _log(setup, probe)
        return probe.passed

    found = search_fleet(passes, guess=guess, lo=lo, hi=hi, seeds=seeds)
    return FleetNeed(policy=setup.policy.value, rate=rate, search=found, probes=probes)


def fleet_guess(instances: int, load: float, capacity: float | None, lo: int, hi: int) -> int:
    """Capacity scales about linearly with the fleet: where to start the fleet search."""
    if not capacity:
        return hi
    return min(max(math.ceil(instances * load / capacity), lo), hi)


@dataclass(frozen=True, kw_only=True, slots=True)
class FleetSettings:
    """The instances-saved search: the offered load and the fleet sizes searched."""

    load: float | None = None
    """Offered rate; None: round robin's capacity on the sweep's fleet."""
    lo: int = 4
    hi: int = 64
    policies: tuple[str, ...] = ()
    """The policies searched (empty: every policy swept)."""


@dataclass(slots=True)
class WorkloadCapacity:
    """Everything a sweep of one workload found, as saved to ``<workload>.json``."""

    workload: str
    params: str
    fleet: str
    instances: int
    objective: Objective
    plan: RunPlan
    search: SearchSettings
    capacities: list[Capacity]
    load: float | None = None
    needs: list[FleetNeed] = field(default_factory=list)
    fleet_range: tuple[int, int] = (4, 64)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def capacity(self, policy: str) -> Capacity | None:
        return next((c for c in self.capacities if c.policy == policy), None)

    def need(self, policy: str) -> FleetNeed | None:
        return next((n for n in self.needs if n.policy == policy), None)


def parse_starts(text: str) -> dict[str, float]:
    """``"30,prefix=120"`` -> ``{"": 30, "prefix": 120}`` (``""``: every other policy)."""
    out: dict[str, float] = {"": 10.0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.rpartition("=")
        try:
            out[name.strip() if sep else ""] = float(value)
        except ValueError:
            raise ValueError(f"--start {part!r}: expected RATE or POLICY=RATE") from None
    return out


def describe_fixed(params: Common) -> str:
    """The workload's parameters but those each probe sets (rate, requests, seed)."""
    return ", ".join(
        part
        for part in describe(params).split(", ")
        if part.split("=")[0] not in ("rate", "requests", "seed")
    )


def _setups(
    workload: str,
    overrides: dict[str, str | int | float],
    policies: Sequence[Policy],
    engine: EngineConfig,
    router: RouterConfig,
    plan: RunPlan,
    objective: Objective,
) -> list[ProbeSetup]:
    frozen = tuple(sorted(overrides.items()))
    return [
        ProbeSetup(
            workload=workload,
            overrides=frozen,
            policy=p,
            engine=engine,
            router=router,
            plan=plan,
            objective=objective,
        )
        for p in policies
    ]


def fleet_load(
    fleet: FleetSettings | None,
    capacities: Sequence[Capacity],
    previous: WorkloadCapacity | None,
    measured: tuple[int, Objective, RunPlan],
) -> float | None:
    """The offered load the fleet search sizes fleets for: the one asked for, else round
    robin's capacity (from this sweep, or from ``previous`` when it measured the same
    ``(instances, objective, plan)``), else the load ``previous`` chose, so a rerun of a
    subset of policies keeps the full sweep's load; else the lowest capacity found (round
    robin met the objective at no rate). None: no fleet search."""
    if fleet is None:
        return None
    if fleet.load is not None:
        return fleet.load
    comparable = (
        previous is not None
        and (
            previous.instances,
            previous.objective,
            previous.plan,
        )
        == measured
    )
    rr_policy = Policy.ROUND_ROBIN.value
    rr = next((c for c in capacities if c.policy == rr_policy), None)
    if rr is None and comparable and previous is not None:
        rr = previous.capacity(rr_policy)
    if rr is not None and rr.search.lo:
        return rr.search.lo
    if comparable and previous is not None and previous.load is not None:
        return previous.load
    return min((c.search.lo for c in capacities if c.search.lo), default=None)


def sweep(
    workload: str,
    overrides: dict[str, str | int | float],
    *,
    policies: Sequence[Policy],
    engine: EngineConfig,
    router: RouterConfig,
    instances: int,
    plan: RunPlan,
    objective: Objective,
    search: SearchSettings,
    fleet: FleetSettings | None,
    starts: Mapping[str, float] | None = None,
    jobs: int = 1,
    params: str = "",
    fleet_text: str = "",
    previous: WorkloadCapacity | None = None,
    verbose: bool = True,
) -> WorkloadCapacity:
    """Each policy's capacity on ``workload``, then (``fleet``) the fleet each needs for
    one offered load; policies run in ``jobs`` processes. ``starts`` maps a policy to the
    rate its search starts from (default: ``search.start``); ``previous`` (an earlier sweep
    of the same workload and settings) gives round robin's capacity when it is not rerun."""
    began, cpu = time.monotonic(), time.process_time()
    setups = _setups(workload, overrides, policies, engine, router, plan, objective)
    searches = [replace(search, start=(starts or {}).get(p.value, search.start)) for p in policies]
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        capacities = list(
            pool.map(
                find_capacity, setups, [instances] * len(setups), searches, [verbose] * len(setups)
            )
        )
        out = WorkloadCapacity(
            workload=workload,
            params=params,
            fleet=fleet_text,
            instances=instances,
            objective=objective,
            plan=plan,
            search=search,
            capacities=capacities,
        )
        load = fleet_load(fleet, capacities, previous, (instances, objective, plan))
        if fleet is not None and load is not None:
            out.load, out.fleet_range = load, (fleet.lo, fleet.hi)
            guesses = [
                fleet_guess(instances, load, c.search.lo, fleet.lo, fleet.hi) for c in capacities
            ]
            futures = [
                pool.submit(
                    find_fleet,
                    s,
                    load,
                    guess=g,
                    lo=fleet.lo,
                    hi=fleet.hi,
                    seeds=search.seeds,
                    verbose=verbose,
                )
                for s, g in zip(setups, guesses, strict=True)
                if not fleet.policies or s.policy.value in fleet.policies
            ]
            out.needs = [f.result() for f in futures]
    out.wall_s = time.monotonic() - began
    out.cpu_s = (
        time.process_time()
        - cpu
        + sum(p.cpu_s for c in out.capacities for p in c.probes)
        + sum(p.cpu_s for n in out.needs for p in n.probes)
    )
    return out


def same_settings(a: WorkloadCapacity, b: WorkloadCapacity) -> bool:
    """Whether two sweeps measured the same thing (their results can sit in one table)."""
    return (
        a.workload,
        a.params,
        a.fleet,
        a.instances,
        a.objective,
        a.plan,
        a.search.seeds,
        a.search.precision,
    ) == (
        b.workload,
        b.params,
        b.fleet,
        b.instances,
        b.objective,
        b.plan,
        b.search.seeds,
        b.search.precision,
    )


def merge(previous: WorkloadCapacity, new: WorkloadCapacity) -> WorkloadCapacity:
    """``new`` with the policies only ``previous`` measured (same settings, and the same
    fleet-search load for its fleet needs), in policy order; runtimes add up."""
    order = {p.value: i for i, p in enumerate(Policy)}
    ran = {c.policy for c in new.capacities}
    new.capacities = sorted(
        [*new.capacities, *(c for c in previous.capacities if c.policy not in ran)],
        key=lambda c: order.get(c.policy, 99),
    )
    if previous.load == new.load:
        searched = {n.policy for n in new.needs}
        new.needs = sorted(
            [*new.needs, *(n for n in previous.needs if n.policy not in searched)],
            key=lambda n: order.get(n.policy, 99),
        )
    new.wall_s += previous.wall_s
    new.cpu_s += previous.cpu_s
    return new


# -- persistence ------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """Dataclasses (nested) as plain JSON-able data; infinities as None."""
    if hasattr(value, "__dataclass_fields__"):
        return {k: to_json(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _probe(data: dict[str, Any]) -> Probe:
    fields: dict[str, Any] = dict(data)
    for key in ("p50_s", "p99_s"):  # a window with a failed request: infinite, saved as null
        if fields[key] is None:
            fields[key] = math.inf
    return Probe(**fields)


def _runs(data: list[list[Any]]) -> tuple[tuple[float, int, bool], ...]:
    return tuple((float(x), int(s), bool(ok)) for x, s, ok in data)


def from_json(data: dict[str, Any]) -> WorkloadCapacity:
    """A :class:`WorkloadCapacity` from :func:`to_json`'s output."""
    search = dict(data["search"])
    search["seeds"] = tuple(search["seeds"])
    return WorkloadCapacity(
        workload=data["workload"],
        params=data["params"],
        fleet=data["fleet"],
        instances=data["instances"],
        objective=Objective(**({"min_served": 0.0} | data["objective"])),
        plan=RunPlan(**data["plan"]),
        search=SearchSettings(**search),
        capacities=[
            Capacity(
                policy=c["policy"],
                instances=c["instances"],
                search=RateSearch(
                    lo=c["search"]["lo"], hi=c["search"]["hi"], runs=_runs(c["search"]["runs"])
                ),
                probes=[_probe(p) for p in c["probes"]],
            )
            for c in data["capacities"]
        ],
        load=data["load"],
        needs=[
            FleetNeed(
                policy=n["policy"],
                rate=n["rate"],
                search=FleetSearch(
                    instances=n["search"]["instances"], runs=_runs(n["search"]["runs"])
                ),
                probes=[_probe(p) for p in n["probes"]],
            )
            for n in data["needs"]
        ],
        fleet_range=(data["fleet_range"][0], data["fleet_range"][1]),
        wall_s=data["wall_s"],
        cpu_s=data["cpu_s"],
    )


def save(result: WorkloadCapacity, folder: Path) -> Path:
    path = folder / f"{result.workload}.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(to_json(result), option=orjson.OPT_INDENT_2))
    return path


def load_one(folder: Path, workload: str) -> WorkloadCapacity | None:
    path = folder / f"{workload}.json"
    return from_json(orjson.loads(path.read_bytes())) if path.exists() else None


def load_all(folder: Path) -> list[WorkloadCapacity]:
    """Every saved sweep under ``folder``."""
    return [from_json(orjson.loads(p.read_bytes())) for p in sorted(folder.glob("*.json"))]


# -- policies, summaries and the report -------------------------------------------------------


def capacity_policies() -> tuple[Policy, ...]:
    """``all`` for a capacity sweep: the four, and ``cache-aware`` when bench/policies.py
    has it."""
    extra = tuple(p for p in Policy if p.value == "cache-aware")
    return (*ALL_POLICIES, *extra)


def parse_policies(text: str) -> tuple[Policy, ...]:
    """As :func:`bench.policies.parse_policies`, with ``all`` = :func:`capacity_policies`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if "all" not in names:
        return _parse(text)
    chosen = [*capacity_policies(), *_parse(",".join(n for n in names if n != "all"))]
    return tuple(dict.fromkeys(chosen))


BASELINE = Policy.ROUND_ROBIN.value
PRODUCT = Policy.PREFIX_SPILL.value


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _capacity_cell(c: Capacity | None) -> str:
    if c is None:
        return "-"
    lo, hi = c.search.lo, c.search.hi
    if lo is None:
        return f"< {_rate(hi)}"
    return f"{_rate(lo)}" if hi is not None else f">= {_rate(lo)}"


def ratio(a: Capacity | None, b: Capacity | None) -> tuple[float, float, float] | None:
    """``a``'s capacity over ``b``'s, with the range the two brackets allow."""
    if a is None or b is None or not a.search.lo or not b.search.lo:
        return None
    lo_a, lo_b = a.search.lo, b.search.lo
    hi_a, hi_b = a.search.hi or lo_a, b.search.hi or lo_b
    return lo_a / lo_b, lo_a / hi_b, hi_a / lo_b


def knee_goodput(c: Capacity) -> tuple[float, float, float, float, float] | None:
    """Mean over the seeds at the knee: goodput req/s, output tok/s, hit rate, P50, P99."""
    knee = c.knee
    if not knee:
        return None
    n = len(knee)
    return (
        sum(p.goodput_rps for p in knee) / n,
        sum(p.goodput_tps for p in knee) / n,
        sum(p.hit_rate for p in knee) / n,
        max(p.p50_s for p in knee),
        max(p.p99_s for p in knee),
    )


def summary(result: WorkloadCapacity) -> str:
    lines = [f"capacity {result.workload} ({result.objective}):"]
    for c in result.capacities:
        prec = c.search.precision
        lines.append(
            f"  {c.policy}: {_capacity_cell(c)} req/s"
            + (f" (+{prec:.1%} precision)" if prec is not None else "")
            + f", {len(c.search.runs)} runs"
        )
    r = ratio(result.capacity(PRODUCT), result.capacity(BASELINE))
    if r:
        lines.append(f"  {PRODUCT} / {BASELINE}: {r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f}x)")
    if result.load is not None:
        needs = ", ".join(f"{n.policy} {n.search.instances or '>max'}" for n in result.needs)
        lines.append(f"  instances for {result.load:.3g} req/s: {needs}")
    lines.append(f"  {result.wall_s:.0f} s wall, {result.cpu_s:.0f} CPU s")
    return "\n".join(lines)


def _policies_of(results: Sequence[WorkloadCapacity]) -> list[str]:
    order = {p.value: i for i, p in enumerate(Policy)}
    names = {c.policy for r in results for c in r.capacities}
    return sorted(names, key=lambda n: order.get(n, 99))


def _workload_order(names: Sequence[str]) -> list[str]:
    known = (
        "system-prompt",
        "rag",
        "chat",
        "long-system-chat",
        "trace-like",
        "code",
        "group-prompts",
        "hot-prefix",
        "unique",
    )
    return sorted(names, key=lambda n: (known.index(n) if n in known else 99, n))


def write_report(folder: Path) -> Path:
    """``report.md`` and PNGs for every sweep saved under ``folder``."""
    from bench.report import plot_capacity, plot_fleet_needs

    by_name = {r.workload: r for r in load_all(folder)}
    results = [by_name[n] for n in _workload_order(list(by_name))]
    policies = _policies_of(results)
    plots = folder / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Capacity at a TTFT objective",
        "",
        "Generated by `prefix-router bench capacity` (discrete-event simulation, model "
        "seconds); reproduce with `bench/scripts/capacity.py` (bench/README.md).",
        "",
    ]
    if results:
        first = max(results, key=lambda r: r.objective.min_served)
        unchecked = [r.workload for r in results if not r.objective.min_served]
        lines += [
            f"**Objective**: {first.objective}, over the requests that arrive after the "
            f"warm-up (the first part of the run, caches start empty; per workload below) and "
            f"before its last new arrival; completions are counted in the same window, "
            f"whenever their requests arrived. **Fleet**: {first.fleet}.",
            "",
        ]
        if unchecked and len(unchecked) < len(results):
            lines += [
                f"**Not checked for keeping up** (measured before the check): "
                f"{', '.join(unchecked)}. Their capacities met the TTFT bounds, but may be "
                f"rates at which decoding falls behind (in-flight requests pile up while "
                f"first tokens stay fast); a policy with a lower figure there is not "
                f"necessarily worse.",
                "",
            ]
        lines += [
            f"**Search**: geometric bracketing (x{first.search.factor:g}) from a start rate, "
            f"then bisection to hi/lo <= {1 + first.search.precision:g}; a rate passes only "
            f"if it passes on every seed (workload and simulation seed; 3, or 2 where stated); "
            f"the bracketing and bisection screen with one seed (the first, then any that "
            f"failed a confirmation) and the answer is confirmed on the others. The capacity "
            f"shown is the highest rate that passed on all seeds; a rate at most the precision "
            f"above it failed on one. `< 1` : the objective was missed even at 1 request/s.",
            "",
        ]
    head = " | ".join(policies)
    lines += [
        "## Capacity (requests/s within the objective)",
        "",
        f"| workload | {head} | {PRODUCT} / {BASELINE} | precision | runs each |",
        "|---" * (len(policies) + 4) + "|",
    ]
    for r in results:
        cells = " | ".join(_capacity_cell(r.capacity(p)) for p in policies)
        rt = ratio(r.capacity(PRODUCT), r.capacity(BASELINE))
        ratio_cell = f"**{rt[0]:.2f}x** ({rt[1]:.2f}-{rt[2]:.2f})" if rt else "-"
        precs = [c.search.precision for c in r.capacities if c.search.precision is not None]
        runs = "/".join(str(len(c.search.runs)) for c in r.capacities)
        lines.append(
            f"| {r.workload} | {cells} | {ratio_cell} | <= {max(precs, default=0):.1%} | {runs} |"
        )
    lines += [
        "",
        "The ratio's range in brackets is what the two brackets allow (each "
        "capacity lies between its value and the lowest rate that failed).",
        "",
        "## Goodput at each policy's knee",
        "",
        "Mean over the seeds at the capacity. Goodput: requests per second that "
        "completed without error with TTFT within the P99 bound, and their output "
        "tokens per second, over the measurement window. Completed / offered: requests "
        "completed in the window per second over the offered rate (the worst seed).",
        "",
        "| workload | policy | capacity req/s | goodput req/s | output tok/s | hit rate "
        "| worst P50 ms | worst P99 ms | completed / offered |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for c in r.capacities:
            g = knee_goodput(c)
            if g is None:
                continue
            served = [p.served_fraction for p in c.knee if p.served_fraction is not None]
            lines.append(
                f"| {r.workload} | {c.policy} | {_rate(c.search.lo)} | {g[0]:.3g} | "
                f"{g[1]:,.0f} | {g[2]:.0%} | {g[3] * 1000:,.0f} | "
                f"{g[4] * 1000:,.0f} | {f'{min(served):.0%}' if served else 'not measured'} |"
            )
    with_needs = [r for r in results if r.needs]
    if with_needs:
        lines += [
            "",
            "## Instances needed for a fixed load",
            "",
            "The smallest fleet that meets the objective at the offered rate shown "
            f"(round robin's capacity on {with_needs[0].instances} instances unless "
            "stated), searched over "
            "{}-{} instances with the same seed rule.".format(*with_needs[0].fleet_range),
            "",
            f"| workload | offered req/s | {head} | {PRODUCT} saves vs {BASELINE} |",
            "|---" * (len(policies) + 3) + "|",
        ]
        for r in with_needs:
            counts = {n.policy: n.search.instances for n in r.needs}
            low, high = r.fleet_range
            cells = " | ".join(_fleet_cell(counts.get(p), p in counts, low, high) for p in policies)
            rr, spill = counts.get(BASELINE), counts.get(PRODUCT)
            saved = f"{rr - spill} ({(rr - spill) / rr:.0%})" if rr and spill else "-"
            rr_cap = r.capacity(BASELINE)
            note = "" if rr_cap is None or rr_cap.search.lo else " (\\*)"
            lines.append(f"| {r.workload} | {r.load:.3g}{note} | {cells} | {saved} |")
        plot_fleet_needs(
            {r.workload: {n.policy: n.search.instances for n in r.needs} for r in with_needs},
            plots / "instances-needed.png",
            "Instances needed at a fixed offered load",
            reference=with_needs[0].instances,
        )
        lines += [
            "",
            "(\\*) Round robin meets the objective at no rate on this fleet: the "
            "load is the lowest capacity another policy has.",
            "",
            "![instances needed](plots/instances-needed.png)",
        ]
    lines += [
        "",
        "## TTFT against offered rate",
        "",
        "Seed 1's runs of each search; dotted lines: each policy's capacity.",
        "",
    ]
    for r in results:
        curves = {
            c.policy: [
                (p.rate, _finite(p.p50_s), _finite(p.p99_s))
                for p in c.probes
                if p.seed == r.search.seeds[0]
            ]
            for c in r.capacities
        }
        knees = {c.policy: c.search.lo for c in r.capacities}
        name = f"capacity-{r.workload}.png"
        plot_capacity(
            curves,
            knees,
            (r.objective.p50_s, r.objective.p99_s),
            plots / name,
            f"{r.workload}, {r.instances} instances",
        )
        lines += [
            f"### {r.workload}",
            "",
            f"Workload: {r.params}. Each run: at least "
            f"{r.plan.requests} requests and {r.plan.min_duration_s:g} s of arrivals, "
            f"the first {r.plan.warmup:.0%} of the arrivals' span not measured; "
            f"{len(r.search.seeds)} seeds.",
            "",
            f"![{r.workload}](plots/{name})",
            "",
        ]
    wall = sum(r.wall_s for r in results)
    cpu = sum(r.cpu_s for r in results)
    lines += [
        "## Runtime",
        "",
        "| workload | runs | wall s | CPU s |",
        "|---|---|---|---|",
        *[
            f"| {r.workload} | {sum(len(c.search.runs) for c in r.capacities)} + "
            f"{sum(len(n.search.runs) for n in r.needs)} | {r.wall_s:.0f} | {r.cpu_s:.0f} |"
            for r in results
        ],
        f"| total | | {wall:.0f} | {cpu:.0f} |",
        "",
    ]
    out = folder / "report.md"
    out.write_text("\n".join(lines))
    return out


def _fleet_cell(n: int | None, searched: bool, low: int, high: int) -> str:
    if not searched:
        return "-"
    if n is None:
        return f"> {high}"
    return f"<= {n}" if n == low else str(n)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.nan
