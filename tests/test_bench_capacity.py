"""Capacity at a TTFT objective: the searches as pure functions over known knees, the
window a probe measures, and ``prefix-router bench capacity`` end to end on a tiny fleet."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.capacity import (
    Capacity,
    FleetNeed,
    FleetSearch,
    FleetSettings,
    Objective,
    ProbeSetup,
    RateSearch,
    RunPlan,
    SearchSettings,
    WorkloadCapacity,
    fleet_guess,
    fleet_load,
    from_json,
    load_all,
    measure,
    merge,
    run_probe,
    same_settings,
    search_fleet,
    search_rate,
    to_json,
    tpot_p50,
)
from bench.policies import Policy
from bench.results import RequestRecord, RunResult
from prefix_router.core.config import RouterConfig
from prefix_router.ops.cli import main
from vllm_sim.config import make_config


def knees(*per_seed: float) -> dict[int, float]:
    """Seed ``i + 1`` passes below ``per_seed[i]`` (inclusive)."""
    return {i + 1: k for i, k in enumerate(per_seed)}


RATE_CASES = [
    # (knee per seed, start, factor, precision)
    (knees(10.0, 10.0, 10.0), 1.0, 1.4, 0.05),  # start far below
    (knees(10.0, 10.0, 10.0), 500.0, 1.4, 0.05),  # far above
    (knees(10.0, 10.0, 10.0), 10.0, 1.4, 0.05),  # exactly at it
    (knees(37.3, 37.3, 37.3), 20.0, 2.0, 0.01),  # fine precision
    (knees(50.0, 30.0, 45.0), 20.0, 1.4, 0.05),  # seed 1 optimistic: confirmation fails
    (knees(30.0, 50.0, 29.0), 100.0, 1.4, 0.05),  # seed 1 close, seed 3 lowest
    (knees(9.0, 10.0), 9.0, 1.5, 0.02),  # two seeds
]


@pytest.mark.parametrize(("knee", "start", "factor", "precision"), RATE_CASES)
def test_the_rate_search_brackets_the_lowest_seeds_knee(
    knee: dict[int, float], start: float, factor: float, precision: float
) -> None:
    def passes(rate: float, seed: int) -> bool:
        return rate <= knee[seed]

    found = search_rate(passes, start=start, seeds=tuple(knee), factor=factor, precision=precision)
    assert found.lo is not None and found.hi is not None
    assert found.lo <= min(knee.values()) < found.hi
    assert found.hi / found.lo <= 1 + precision + 1e-3  # rates rounded to 4 digits
    assert all(passes(found.lo, s) for s in knee)  # the seed rule holds for the answer
    assert not all(passes(found.hi, s) for s in knee)
    pairs = [(x, s) for x, s, _ in found.runs]
    assert len(pairs) == len(set(pairs)), "no run is repeated"
    # Bounded: bracketing from the start, bisection to the precision, confirmation.
    brackets = abs(math.log(start / min(knee.values()))) / math.log(factor) + 2
    halvings = math.log2(math.log(factor) / math.log(1 + precision)) + 1
    assert len(found.runs) <= 3 * (brackets + halvings + len(knee))


def test_the_rate_search_stops_at_its_limits() -> None:
    never = search_rate(lambda rate, seed: False, start=10, min_rate=1.0)
    assert never.lo is None and never.hi == 1.0
    always = search_rate(lambda rate, seed: True, start=10, max_rate=100.0)
    assert always.lo == 100.0 and always.hi is None and always.precision is None
    assert {s for x, s, _ in always.runs if x == 100.0} == {1, 2, 3}  # confirmed at the top


def test_only_the_knee_is_confirmed_on_every_seed() -> None:
    found = search_rate(lambda rate, seed: rate <= 10, start=1, factor=2, precision=0.05)
    later = {x for x, s, _ in found.runs if s != 1}  # seed 1 leads: no confirmation failed
    assert later == {found.lo}


FLEET_CASES = [
    # (instances needed per seed, guess, lo, hi, expected answer)
    (knees(8, 8, 8), 8, 4, 64, 8),
    (knees(8, 8, 8), 4, 4, 64, 8),
    (knees(8, 8, 8), 64, 4, 64, 8),
    (knees(5, 9, 7), 5, 4, 64, 9),  # seed 1 optimistic: the answer moves up
    (knees(3, 3, 3), 10, 4, 64, 4),  # the smallest fleet searched passes
    (knees(70, 70, 70), 10, 4, 64, None),  # not even the largest
    (knees(33, 31, 32), 17, 4, 64, 33),
]


@pytest.mark.parametrize(("need", "guess", "lo", "hi", "expected"), FLEET_CASES)
def test_the_fleet_search_finds_the_smallest_fleet_every_seed_passes(
    need: dict[int, float], guess: int, lo: int, hi: int, expected: int | None
) -> None:
    found = search_fleet(
        lambda n, seed: n >= need[seed], guess=guess, lo=lo, hi=hi, seeds=tuple(need)
    )
    assert found.instances == expected
    assert len(found.runs) <= 3 * (2 * math.log2(hi - lo + 1) + 2 + len(need))


@pytest.mark.parametrize(
    ("instances", "load", "capacity", "expected"),
    [
        (8, 10.0, 10.0, 8),
        (8, 10.0, 20.0, 4),
        (8, 10.0, 13.0, 7),
        (8, 10.0, 1.0, 64),
        (8, 10.0, None, 64),
        (8, 1.0, 100.0, 4),
    ],
)
def test_the_fleet_guess_scales_linearly_within_the_range(
    instances: int, load: float, capacity: float | None, expected: int
) -> None:
    assert fleet_guess(instances, load, capacity, 4, 64) == expected


def record(at: float, ttft: float | None, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        arrival_s=at, instance="a", ttft_s=ttft, e2e_s=ttft, output_tokens=10, error=error
    )


def result_of(records: list[RequestRecord]) -> RunResult:
    return RunResult(
        mode="des",
        workload="w",
        policy="round-robin",
        params="",
        records=records,
        instances=[],
        duration_s=10.0,
    )


def test_a_probe_measures_only_its_window() -> None:
    slow_warmup = [record(t * 0.1, 9.0) for t in range(10)]  # 0.0 .. 0.9 s: cold caches
    steady = [record(1 + t * 0.1, 0.1) for t in range(80)]  # 1.0 .. 8.9 s
    drain = [record(9.5, 5.0)]  # after the last new arrival
    probe = measure(
        result_of(slow_warmup + steady + drain),
        (1.0, 9.0),
        Objective(),
        rate=10.0,
        instances=2,
        seed=1,
    )
    assert probe.passed and probe.requests == 80 and probe.good == 80
    assert probe.p99_s == pytest.approx(0.1) and probe.window_s == 8.0
    assert probe.goodput_rps == 10.0 and probe.goodput_tps == 100.0


@pytest.mark.parametrize(
    ("records", "objective", "passed"),
    [
        ([record(1, 0.1)] * 98 + [record(1, 3.0)] * 2, Objective(), False),  # P99 over 2 s
        ([record(1, 0.1)] * 99 + [record(1, 3.0)], Objective(), True),  # P99 interpolated
        ([record(1, 0.6)] * 100, Objective(), False),  # P50 over 0.5 s
        ([record(1, 0.6)] * 100, Objective(p50_s=1.0), True),
        ([record(1, 0.1)] * 99 + [record(1, None, "500")], Objective(), False),  # an error
        # An allowed error still counts as a request that never got its first token:
        ([record(1, 0.1)] * 99 + [record(1, None, "500")], Objective(max_errors=1), False),
        ([record(1, 0.1)] * 199 + [record(1, None, "500")], Objective(max_errors=1), True),
        ([record(20, 0.1)], Objective(), False),  # nothing measured
    ],
)
def test_the_objective_verdict(
    records: list[RequestRecord], objective: Objective, passed: bool
) -> None:
    probe = measure(result_of(records), (0.0, 10.0), objective, rate=1, instances=1, seed=1)
    assert probe.passed is passed


def answered(at: float, ttft: float, e2e: float) -> RequestRecord:
    return RequestRecord(arrival_s=at, instance="a", ttft_s=ttft, e2e_s=e2e, output_tokens=10)


def test_a_fleet_that_falls_behind_fails_however_fast_its_first_tokens() -> None:
    # 10 requests/s for 10 s, first tokens at once, but every answer takes 20 s: decoding
    # has fallen behind and nothing completes in the window.
    behind = [answered(t * 0.1, 0.1, 20.0) for t in range(100)]
    probe = measure(result_of(behind), (0.0, 10.0), Objective(), rate=10, instances=1, seed=1)
    assert probe.p99_s == pytest.approx(0.1) and probe.completed == 0
    assert not probe.passed and probe.served_fraction == 0.0
    unchecked = Objective(min_served=0.0)
    assert measure(result_of(behind), (0.0, 10.0), unchecked, rate=10, instances=1, seed=1).passed


def test_a_conversation_workload_sent_half_its_turns_fails() -> None:
    # Offered 10 turns/s, but each next turn waited for a slow answer: 5/s were sent.
    throttled = [answered(t * 0.2, 0.1, 0.5) for t in range(50)]
    probe = measure(result_of(throttled), (0.0, 10.0), Objective(), rate=10, instances=1, seed=1)
    assert probe.completed == 48 and probe.served_fraction == pytest.approx(0.48)
    assert not probe.passed
    kept_up = [answered(t * 0.1, 0.1, 0.5) for t in range(100)]
    probe = measure(result_of(kept_up), (0.0, 10.0), Objective(), rate=10, instances=1, seed=1)
    assert probe.served_fraction == pytest.approx(0.96) and probe.passed


def test_decode_slower_than_the_objective_fails_judged_on_the_windows_first_half() -> None:
    # 10 output tokens; (e2e - ttft) / 9 per token. The first half decodes at 100 ms a
    # token, the second (which would finish as arrivals stop) at 10 ms.
    slow_first = [answered(t * 0.1, 0.1, 0.1 + 0.9 * (1 if t < 50 else 0.1)) for t in range(100)]
    tpot = Objective(p50_s=1.0, p99_s=2.0, min_served=0.0, max_tpot_s=0.05)
    probe = measure(result_of(slow_first), (0.0, 10.0), tpot, rate=10, instances=1, seed=1)
    assert probe.tpot_p50_s == pytest.approx(0.1) and not probe.passed
    fast_first = [answered(t * 0.1, 0.1, 0.1 + 0.9 * (0.1 if t < 50 else 1)) for t in range(100)]
    probe = measure(result_of(fast_first), (0.0, 10.0), tpot, rate=10, instances=1, seed=1)
    assert probe.tpot_p50_s == pytest.approx(0.01) and probe.passed
    one_token = RequestRecord(arrival_s=0, instance="a", ttft_s=0.1, e2e_s=0.1, output_tokens=1)
    assert tpot_p50([one_token, record(0, None, "500")]) is None  # nothing decoded


TINY = [
    "--set",
    "prompts=4",
    "--set",
    "prompt_tokens=600",
    "--set",
    "output_min=16",
    "--set",
    "output_max=48",
]


def test_bench_capacity_end_to_end_brackets_the_knee(tmp_path: Path) -> None:
    code = main(
        [
            "bench",
            "capacity",
            "--workload",
            "system-prompt",
            *TINY,
            "--policies",
            "round-robin,prefix-spill",
            "--instances",
            "2",
            "--num-gpu-blocks",
            "2000",
            "--prefill-tokens-per-s",
            "6000",
            "--run-requests",
            "300",
            "--seeds",
            "2",
            "--start",
            "5",
            "--precision",
            "0.1",
            "--fleet-min",
            "1",
            "--fleet-max",
            "6",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    saved = json.loads((tmp_path / "system-prompt.json").read_text())
    assert {"objective", "plan", "search", "capacities", "needs", "load"} <= set(saved)
    report = (tmp_path / "report.md").read_text()
    assert "## Capacity" in report and "P99 TTFT <= 2 s" in report
    assert (tmp_path / "plots" / "capacity-system-prompt.png").stat().st_size > 0
    assert (tmp_path / "plots" / "instances-needed.png").stat().st_size > 0

    [sweep] = load_all(tmp_path)
    assert [c.policy for c in sweep.capacities] == ["round-robin", "prefix-spill"]
    rr = sweep.capacity("round-robin")
    assert rr is not None and sweep.load == rr.search.lo
    need = sweep.need("round-robin")
    assert need is not None and need.search.instances is not None
    assert need.search.instances <= 2  # round robin serves its own capacity on its fleet
    for capacity in sweep.capacities:
        lo, hi = capacity.search.lo, capacity.search.hi
        assert lo is not None and hi is not None and hi / lo <= 1.1 + 1e-3
        # The answer brackets the knee in fresh runs: every seed passes at lo, one fails at hi.
        setup = ProbeSetup(
            workload="system-prompt",
            overrides=(
                ("output_max", "48"),
                ("output_min", "16"),
                ("prompt_tokens", "600"),
                ("prompts", "4"),
            ),
            policy=Policy(capacity.policy),
            engine=make_config(num_gpu_blocks=2000, prefill_tokens_per_s=6000),
            router=RouterConfig(),
            plan=RunPlan(requests=300),
        )
        assert all(run_probe(setup, lo, 2, seed).passed for seed in (1, 2))
        assert not all(run_probe(setup, hi, 2, seed).passed for seed in (1, 2))


def sweep_of(policies: dict[str, float], load: float | None = 10.0) -> WorkloadCapacity:
    """A saved sweep with the given capacities (and a fleet need of 8 for each)."""
    caps = [
        Capacity(policy=p, instances=8, search=RateSearch(lo, lo * 1.05, ()), probes=[])
        for p, lo in policies.items()
    ]
    needs = [
        FleetNeed(policy=p, rate=load or 0.0, search=FleetSearch(8, ()), probes=[])
        for p in policies
    ]
    return WorkloadCapacity(
        workload="w",
        params="",
        fleet="",
        instances=8,
        objective=Objective(),
        plan=RunPlan(),
        search=SearchSettings(start=1.0),
        capacities=caps,
        load=load,
        needs=needs,
        wall_s=1.0,
        cpu_s=2.0,
    )


def test_a_rerun_of_one_policy_keeps_the_others_in_policy_order() -> None:
    old = sweep_of({"round-robin": 10.0, "prefix": 30.0, "prefix-spill": 12.0})
    new = sweep_of({"prefix-spill": 20.0, "cache-aware": 15.0})
    merged = merge(old, new)
    assert [(c.policy, c.search.lo) for c in merged.capacities] == [
        ("round-robin", 10.0),
        ("prefix", 30.0),
        ("prefix-spill", 20.0),
        ("cache-aware", 15.0),
    ]
    assert [n.policy for n in merged.needs] == [
        "round-robin",
        "prefix",
        "prefix-spill",
        "cache-aware",
    ]
    assert merged.wall_s == 2.0 and merged.cpu_s == 4.0
    assert same_settings(old, new)
    assert from_json(json.loads(json.dumps(to_json(merged)))) == merged  # survives JSON
    # Fleet needs for another load are not mixed with the new ones.
    other = merge(sweep_of({"round-robin": 10.0}, load=5.0), sweep_of({"prefix": 30.0}))
    assert [n.policy for n in other.needs] == ["prefix"]


def caps_of(policies: dict[str, float | None]) -> list[Capacity]:
    return [
        Capacity(policy=p, instances=8, search=RateSearch(lo, None, ()), probes=[])
        for p, lo in policies.items()
    ]


SAME = (8, Objective(), RunPlan())

FLEET_LOAD_CASES = [
    # (asked, this sweep's capacities, previous sweep, measured as, load)
    (7.0, {"round-robin": 10.0}, None, SAME, 7.0),  # asked for
    (None, {"round-robin": 10.0, "prefix": 30.0}, None, SAME, 10.0),  # round robin's knee
    (None, {"prefix": 30.0}, {"round-robin": 12.0}, SAME, 12.0),  # an earlier round robin
    (None, {"prefix": 30.0}, {"round-robin": 12.0}, (4, Objective(), RunPlan()), 30.0),
    # round robin never met the objective: a subset rerun keeps the full sweep's load ...
    (None, {"prefix": 30.0}, {"round-robin": None, "cache-aware": 20.0}, SAME, 20.0),
    (None, {"round-robin": None, "prefix": 30.0}, {"cache-aware": 20.0}, SAME, 20.0),
    # ... and a first sweep takes the lowest capacity found
    (None, {"round-robin": None, "prefix": 30.0, "cache-aware": 25.0}, None, SAME, 25.0),
    (None, {"round-robin": None}, None, SAME, None),
]


@pytest.mark.parametrize(("asked", "caps", "before", "measured", "load"), FLEET_LOAD_CASES)
def test_the_fleet_search_load_survives_a_rerun_of_some_policies(
    asked: float | None,
    caps: dict[str, float | None],
    before: dict[str, float | None] | None,
    measured: tuple[int, Objective, RunPlan],
    load: float | None,
) -> None:
    previous = None
    if before is not None:
        previous = sweep_of({})
        previous.capacities = caps_of(before)
        previous.load = min((x for x in before.values() if x), default=None)
    got = fleet_load(FleetSettings(load=asked), caps_of(caps), previous, measured)
    assert got == load
    assert fleet_load(None, caps_of(caps), previous, measured) is None
