"""Issue 23's goals again, at a load measured where it can fail us: every router with its
defaults on every workload, heavy-tailed and bursty, on instances sized as the facts file's
Llama-3.1-70B, at 60% of round robin's own capacity, on three seeds.

    flock /tmp/prefix-router-heavy.lock python bench/scripts/routing_at_load.py calibrate
    flock /tmp/prefix-router-heavy.lock python bench/scripts/routing_at_load.py run --jobs 2
    flock /tmp/prefix-router-heavy.lock python bench/scripts/routing_at_load.py capacity --jobs 2
    python bench/scripts/routing_at_load.py report    # report.md, summary.json

``capacity`` finds the product defaults' own capacity at the same objective (searched from
twice round robin's), for the report's capacity table.

Why a second benchmark: ``routing_defaults.py`` (the figures issue 23 was resolved on)
chose each rate where round robin was "55-65% busy with prefill", uncached prompt tokens
over the fleet's prefill rate. That measure leaves out decode and per-step time and barely
moves with the rate on conversation workloads, so on some rows round robin ran past
saturation (mixed: P99 41 s and growing with the run's length) and every "x round robin"
ratio there is flattered. Six of its ten workloads also kept uniform 64-256-token outputs
and Poisson arrivals, and its instances were slower and smaller than the facts' 70B.

What this one changes:

**Load.** ``calibrate`` finds round robin's capacity on each workload: the highest rate at
which it serves the traffic within an interactive objective (:data:`CAPACITY_OBJECTIVE`:
P50 TTFT <= 0.5 s, P99 <= 2 s, median time per output token <= 50 ms), measured over the
second half of a run; a search over rates (bench/capacity.py) to 5%, passed on every seed.
``run`` offers :data:`LOAD` (60%) of that rate: round robin carries 60% of the traffic it
can serve acceptably. Each run records P99 TTFT over the two halves of the window, and the
report flags round robin where the second is over 1.5x the first (a queue growing).

**Measured.** TTFT, shares and the window's hit rate over the same window calibration
measures (the second half of the span of new arrivals: caches warm, conversations all
started); the whole run's hit rate beside it, the one its fleet-LRU bound is for.

**Traffic.** Every workload has lognormal outputs (median 256 tokens, log deviation 1,
capped at 4,096: 1% above ~2,600; code completion and the hot prefix median 48, but the
code part of ``mixed`` takes the mix's 256) and gamma arrivals with coefficient of
variation 2 (clumps; the count in a window varies ~4x Poisson's).

**Instances.** The simulator's ``llama-3.1-70b-8xh100`` profile, as vllm-facts.md gives it:
81,000 KV blocks of 16 (1.3M tokens), 22,000 prompt tokens/s, 17 ms a step. Pools of
shared prompts are scaled with the cache (2.8x ``routing_defaults.py``'s; the per-group
prompts' 128 groups too) so what one instance caches relative to the working set stays as
it was there.

**Seeds.** Round robin, least-request, the cache-aware comparator and the product's
defaults run on seeds 1-3 (workload and simulation); the fixed keys, ``prefix`` (defaults
without spill) and the engine's floor on seed 1. A goal passes only when it passes on every
seed, but "P50 <= best fixed key", judged on seed 1 where the fixed keys ran; the hot
prefix is held to the share goal too (its uncached prefill here is ~0.8 of an instance).
A workload missing any planned run is reported incomplete, not judged.

**Floors.** A P50 goal missed under a floor no router goes under is reported unreachable:
the engine's floor (a run with prefill free) or the requests' own, the median over the
window of each request's ``RequestRecord.ttft_floor_s`` (one step prefilling only what no
earlier request left behind; ``routing_defaults._p50_goal``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.capacity import (  # noqa: E402
    LastArrival,
    Objective,
    ProbeSetup,
    RunPlan,
    SearchSettings,
    find_capacity,
)
from bench.des import DesSettings, simulate  # noqa: E402
from bench.policies import Policy  # noqa: E402
from bench.results import RequestRecord, percentile  # noqa: E402
from bench.scripts.routing_defaults import (  # noqa: E402
    FLOOR,
    FREE_PREFILL_TOKENS_PER_S,
    INSTANCES,
    NUM_GPU_BLOCKS,
    P50_GOAL,
    RATES,
    REQUESTS,
    SCALE,
    THINK,
    UNREACHABLE,
    VARIANTS,
    Outcome,
    Variant,
    _ms,
    _verdict,
    best_fixed,
    figures,
    goal_table,
    goals,
    goals_json,
    write_report,
)
from bench.workloads import generate  # noqa: E402
from prefix_router.core.config import RouterConfig  # noqa: E402
from vllm_sim.config import make_config  # noqa: E402

OUT = ROOT / "bench" / "results" / "routing-at-load"
ENGINE = make_config()
"""The ``llama-3.1-70b-8xh100`` profile: 81,000 blocks, 22,000 prompt tokens/s, t0 17 ms."""
LOAD = 0.6
"""Offered rate over round robin's capacity."""
CAPACITY_OBJECTIVE = Objective(p50_s=0.5, p99_s=2.0, min_served=0.0, max_tpot_s=0.05)
"""Round robin's capacity is the traffic it serves within an interactive objective: P50
TTFT <= 0.5 s and P99 <= 2 s (as bench/scripts/capacity.py), and a median time per output
token <= 50 ms (the facts give 18-25 ms at light load for this model: past 2x, decoding is
what users wait on). Not completions against the offered rate: bursts move that by +-5%
from run to run, and a conversation workload sends fewer turns than offered while its
conversations start (a review found both set the knee of an earlier calibration)."""
WARMUP = 0.5
"""The first half of the span of new arrivals is not measured, in calibration or runs."""
MULTI_TURN_S = 300.0
"""Multi-turn workloads run at least this many model seconds of new arrivals (as
bench/scripts/capacity.py's do): a turn waits for the last answer, and in shorter runs the
window saw conversations still starting, sent fewer turns than offered at any rate."""
MULTI_TURN = ("chat", "long-system-chat", "trace-like", "mixed")
STARTS = {**RATES, "chat": 100.0, "long-system-chat": 40.0, "trace-like": 30.0, "mixed": 20.0}
"""Where each capacity search starts (bench/scripts/capacity.py's round robin starts)."""
SEEDS = (1, 2, 3)
ALL_SEEDS = ("round-robin", "least-request", "cache-aware", "prefix-spill")
"""Variants run on every seed; the others on the first."""
SHAPE: dict[str, str | int | float] = {"outputs": "lognormal", "arrivals": "gamma"}
SHORT_OUTPUTS = {"code": 48, "hot-prefix": 48}
"""Lognormal output medians of the workloads whose answers are short (else 256)."""
POOL_RATIO = ENGINE.num_gpu_blocks / NUM_GPU_BLOCKS
GROUPS: dict[str, dict[str, int | float]] = {"group-prompts": {"groups": 128}}
"""Pools ``routing_defaults.SCALE`` leaves at their defaults, scaled here too: 128 groups of
4,096 tokens fit in one 1.3M-token instance, and the run would measure only cold starts."""


def overrides(workload: str, rate: float, seed: int) -> dict[str, str | int | float]:
    """The workload's parameters here: scaled pools, think times, shape, rate and seed."""
    out: dict[str, str | int | float] = {
        k: (v * POOL_RATIO if k == "pool_scale" else max(1, round(v * POOL_RATIO)))
        for k, v in {**SCALE, **GROUPS}.get(workload, {}).items()
    }
    out.update(THINK.get(workload, {}), **SHAPE, rate=rate, seed=seed)
    if workload in SHORT_OUTPUTS:
        out["output_median"] = SHORT_OUTPUTS[workload]
    out["requests"] = run_plan(workload).requests_at(rate)
    return out


def run_plan(workload: str) -> RunPlan:
    """Requests per run (``routing_defaults.REQUESTS``; multi-turn: :data:`MULTI_TURN_S` of
    arrivals at least), the first half of the arrivals a warm-up."""
    return RunPlan(
        requests=REQUESTS.get(workload, 2048),
        min_duration_s=MULTI_TURN_S if workload in MULTI_TURN else 0.0,
        warmup=WARMUP,
    )


# -- calibrate ----------------------------------------------------------------------------


def capacity(workload: str, start: float, policy: Policy = Policy.ROUND_ROBIN) -> dict[str, Any]:
    """``policy``'s capacity on ``workload`` (passed on every seed), with every probe; round
    robin's by default, the rates every run is offered."""
    base = overrides(workload, start, 1)
    fixed = {k: v for k, v in base.items() if k not in ("rate", "seed", "requests")}
    setup = ProbeSetup(
        workload=workload,
        overrides=tuple(sorted(fixed.items())),
        policy=policy,
        engine=ENGINE,
        router=RouterConfig(),
        plan=run_plan(workload),
        objective=CAPACITY_OBJECTIVE,
    )
    found = find_capacity(
        setup, INSTANCES, SearchSettings(start=start, seeds=SEEDS, precision=0.05), verbose=True
    )
    if found.search.lo is None:
        raise SystemExit(f"{workload}: {policy.value} keeps up at no rate tried")
    return {
        "capacity": found.search.lo,
        "failed_at": found.search.hi,
        "rate": round(LOAD * found.search.lo, 3),
        "probes": [
            {
                "rate": p.rate,
                "passed": p.passed,
                "p50_s": p.p50_s,
                "p99_s": p.p99_s,
                "served": p.served_fraction,
            }
            for p in found.probes
        ],
    }


DEFAULTS_CAPACITY = "capacity-defaults.json"
"""Where ``capacity`` keeps the defaults' capacity at :data:`CAPACITY_OBJECTIVE`."""


def defaults_capacity(workload: str, rr_capacity: float) -> dict[str, Any]:
    """The product's defaults' capacity on ``workload``, searched from twice round robin's."""
    found = capacity(workload, 2 * rr_capacity, Policy.PREFIX_SPILL)
    return {
        "capacity": found["capacity"],
        "failed_at": found["failed_at"],
        "round_robin": rr_capacity,
        "probes": found["probes"],
    }


def _capacity_lines(out: Path) -> list[str]:
    path = out / DEFAULTS_CAPACITY
    if not path.exists():
        return []
    found = json.loads(path.read_text())
    return [
        "",
        "## Capacity of the defaults",
        "",
        "The highest rate the product's defaults serve within the same objective on every "
        "seed (`routing_at_load.py capacity`), against round robin's.",
        "",
        "| workload | defaults (req/s) | lowest failing | round robin | defaults / RR |",
        "|---|---|---|---|---|",
        *(
            f"| {w} | {c['capacity']:g} | {c['failed_at']:g} | {c['round_robin']:g} "
            f"| {c['capacity'] / c['round_robin']:.2f}x |"
            for w, c in found.items()
        ),
    ]


def rates(out: Path) -> dict[str, dict[str, Any]]:
    path = out / "rates.json"
    return json.loads(path.read_text()) if path.exists() else {}


# -- run ----------------------------------------------------------------------------------


def simulate_one(workload: str, rate: float, variant: Variant, seed: int) -> dict[str, Any]:
    """One run's figures: ``routing_defaults.figures`` over the whole run (the hit rate and
    its fleet-LRU bound), TTFT and shares over the window calibration measured (the second
    half of the span of new arrivals: caches warm, conversations all started), and P99 TTFT
    over each half of that window (a queue that grows shows as a second half far above)."""
    router = RouterConfig().patched(dict(variant.router)) if variant.router else RouterConfig()
    engine = (
        make_config(prefill_tokens_per_s=FREE_PREFILL_TOKENS_PER_S)
        if variant.label == FLOOR
        else ENGINE
    )
    settings = DesSettings(
        policy=Policy(variant.policy), engine=engine, router=router, instances=INSTANCES, seed=seed
    )
    started = time.process_time()
    tap = LastArrival(generate(workload, overrides(workload, rate, seed)))
    result = simulate(tap.tapped(), settings)
    row = figures(result, ENGINE.cost.prefill_tokens_per_s)
    row.update(window_figures(result.records, (WARMUP * tap.at, tap.at)))
    row.update(
        workload=workload,
        label=variant.label,
        policy=variant.policy,
        router=dict(variant.router),
        rate=rate,
        seed=seed,
        cpu_s=time.process_time() - started,
    )
    return row


def window_figures(records: Sequence[RequestRecord], window: tuple[float, float]) -> dict[str, Any]:
    """TTFT percentiles, the busiest instance's share of requests and the token hit rate
    of the requests that arrived in ``window``, P99 TTFT over each half of it (TTFT of
    the answered ones: ``figures`` counts the errors, and every goal asks for none), and
    the P50 of their TTFT floors (``RequestRecord.ttft_floor_s``: what no router goes
    under, since each request's TTFT is at least its floor)."""
    start, end = window
    middle = (start + end) / 2
    inside = [r for r in records if start <= r.arrival_s <= end]
    answered = [r for r in inside if r.ttft_s is not None and r.error is None]
    ttfts = sorted(r.ttft_s for r in answered if r.ttft_s is not None)
    halves = [
        sorted(
            r.ttft_s for r in answered if r.ttft_s is not None and (r.arrival_s < middle) == early
        )
        for early in (True, False)
    ]
    counts = Counter(r.instance for r in inside if r.instance is not None)
    prompt = sum(r.prompt_tokens for r in inside)
    floors = sorted(r.ttft_floor_s for r in answered if r.ttft_floor_s is not None)
    return {
        "window_s": [start, end],
        "window_requests": len(inside),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "max_share": max(counts.values()) / (len(inside) / INSTANCES) if counts else math.nan,
        "window_hit_rate": sum(r.cached_tokens or 0 for r in inside) / prompt if prompt else 0.0,
        "ttft_p99_halves_s": [percentile(h, 99) for h in halves],
        "ttft_floor_p50_s": percentile(floors, 50) if floors else None,
    }


def run_path(out: Path, workload: str, label: str, seed: int) -> Path:
    return out / "runs" / workload / f"{label}.s{seed}.json"


def _run_and_save(out: Path, workload: str, rate: float, variant: Variant, seed: int) -> str:
    row = simulate_one(workload, rate, variant, seed)
    path = run_path(out, workload, variant.label, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1) + "\n")
    return (
        f"{workload:>16} {variant.label:>14} s{seed}: hit {row['hit_rate']:.3f} "
        f"(LRU {row['fleet_lru']:.3f}) P50 {row['ttft_p50_s'] * 1000:.0f} ms "
        f"P99 {row['ttft_p99_s'] * 1000:.0f} ms share {row['max_share']:.2f} "
        f"errors {row['errors']} ({row['cpu_s']:.0f} s)"
    )


FLOOR_VARIANT = Variant(FLOOR, "prefix-spill")
"""The defaults with prefill free: the engine's own TTFT at the load (``routing_defaults``'s
``floor``), run on the first seed where the P50 goal applies."""


def plan(workloads: Sequence[str], labels: set[str]) -> list[tuple[str, Variant, int]]:
    """Every (workload, variant, seed) to run: :data:`ALL_SEEDS` on every seed."""
    return [
        (w, v, s)
        for w in workloads
        for v in (*VARIANTS, FLOOR_VARIANT)
        if (not labels or v.label in labels) and (v is not FLOOR_VARIANT or w in P50_GOAL)
        for s in (SEEDS if v.label in ALL_SEEDS else SEEDS[:1])
    ]


# -- report -------------------------------------------------------------------------------


def load(out: Path) -> dict[str, dict[int, dict[str, dict[str, Any]]]]:
    """``rows[workload][seed][label]``."""
    rows: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for path in sorted((out / "runs").glob("*/*.json")):
        row = json.loads(path.read_text())
        rows.setdefault(row["workload"], {}).setdefault(row["seed"], {})[row["label"]] = row
    return rows


def _mean(runs: Sequence[Mapping[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def seed_goals(
    workload: str, by_seed: Mapping[int, Mapping[str, dict[str, Any]]]
) -> list[tuple[str, Outcome, str]]:
    """Each goal of ``routing_defaults.goals`` on every seed: passed only when every seed
    passed, ``unreachable`` when it was on some seed and passed on the others. The fixed
    keys and the engine's floor run on the first seed only, so "P50 <= best fixed key" is
    judged there (another seed's run against them would compare two draws of the traffic).
    No workload is exempt from the share goal: at these rates the hot prefix's uncached
    prefill is ~0.8 of one instance, which a router can keep on it without overloading it."""
    first = min(by_seed)
    fixed = {k: v for k, v in by_seed[first].items() if k.startswith("fixed-") or k == FLOOR}
    per_seed = {
        seed: goals(workload, {**fixed, **runs}, "prefix-spill", one_prefix_exceeds=())
        for seed, runs in sorted(by_seed.items())
    }
    out: list[tuple[str, Outcome, str]] = []
    for i, (name, _, _) in enumerate(per_seed[first]):
        judged = [first] if name == FIXED_GOAL else list(per_seed)
        results = [per_seed[s][i][1] for s in judged]
        figs = " / ".join(per_seed[s][i][2] for s in judged)
        if all(r is None for r in results):
            out.append((name, None, figs))
        elif all(r in (True, UNREACHABLE) for r in results) and UNREACHABLE in results:
            out.append((name, UNREACHABLE, figs))
        else:
            out.append((name, all(r is True for r in results), figs))
    return out


FIXED_GOAL = "P50 <= best fixed key"


def missing(workload: str, by_seed: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """``label.sSEED`` of every run :func:`plan` asks for that ``by_seed`` lacks."""
    return [
        f"{v.label}.s{s}"
        for _, v, s in plan([workload], set())
        if v.label not in by_seed.get(s, {})
    ]


METRICS: tuple[tuple[str, Callable[[Sequence[Mapping[str, Any]], float, float], str]], ...] = (
    ("token hit rate (run)", lambda v, _, __: f"{_mean(v, 'hit_rate'):.3f}"),
    ("token hit rate (window)", lambda v, _, __: f"{_mean(v, 'window_hit_rate'):.3f}"),
    ("P50 TTFT", lambda v, _, __: _ms(_mean(v, "ttft_p50_s"))),
    ("P50 / RR", lambda v, rr50, _: f"{_mean(v, 'ttft_p50_s') / rr50:.2f}"),
    ("P99 TTFT", lambda v, _, __: _ms(_mean(v, "ttft_p99_s"))),
    ("P99 / RR", lambda v, _, rr99: f"{_mean(v, 'ttft_p99_s') / rr99:.2f}"),
    ("max share / mean (worst seed)", lambda v, _, __: f"{max(r['max_share'] for r in v):.2f}"),
    ("errors", lambda v, _, __: str(sum(r["errors"] for r in v))),
)
"""Rows of a workload's table: means over the seeds a column ran on (TTFT and shares over
the window; the run's hit rate is the one its fleet-LRU bound is for)."""
DRIFT = 1.5
"""Round robin's P99 over the window's second half above this multiple of its first half's
is flagged: its queue may be growing, the load too high for the comparison."""


def _load_row(w: str, cal: Mapping[str, Any], by_seed: Mapping[int, Mapping[str, Any]]) -> str:
    halves = []
    for _, runs in sorted(by_seed.items()):
        if "round-robin" in runs:
            first, second = runs["round-robin"]["ttft_p99_halves_s"]
            flag = " **grows**" if second > DRIFT * first else ""
            halves.append(f"{_ms(first)} / {_ms(second)}{flag}")
    return (
        f"| {w} | {cal.get('capacity', math.nan):g} | {cal.get('failed_at', '')} | "
        f"{cal.get('rate', math.nan):g} | {', '.join(halves)} |"
    )


def report(out: Path) -> Path:
    rows = load(out)
    found = rates(out)
    order = [w for w in RATES if w in rows]
    lines = [
        "# Routing with its defaults at 60% of round robin's capacity (issue 23, again)",
        "",
        f"Discrete-event simulation (bench/des.py) of {INSTANCES} instances of the "
        f"`llama-3.1-70b-8xh100` profile ({ENGINE.num_gpu_blocks:,} KV blocks of 16, "
        f"{ENGINE.cost.prefill_tokens_per_s:,.0f} prompt tokens/s, "
        f"{ENGINE.cost.step_overhead_s * 1000:.0f} ms a step); every workload with lognormal "
        "outputs and bursty arrivals; every router with its defaults. The method and how to "
        "reproduce: `bench/scripts/routing_at_load.py` (its docstring).",
        "",
        "## Load",
        "",
        "Round robin's capacity (the highest rate passed on every seed, over the second "
        f"half of a run: {CAPACITY_OBJECTIVE}), the lowest rate that failed, the rate "
        "offered (60% of the capacity), and round robin's P99 TTFT over the first and "
        "second halves of the window "
        f"at that rate, seed by seed (**grows**: the second over {DRIFT:g}x the first).",
        "",
        "| workload | RR capacity (req/s) | lowest failing | rate offered "
        "| RR P99, window's first / second half |",
        "|---|---|---|---|---|",
        *(_load_row(w, found.get(w, {}), rows[w]) for w in order),
        *_capacity_lines(out),
    ]
    summary: dict[str, Any] = {
        "settings": {
            "instances": INSTANCES,
            "num_gpu_blocks": ENGINE.num_gpu_blocks,
            "prefill_tokens_per_s": ENGINE.cost.prefill_tokens_per_s,
            "load": LOAD,
            "seeds": list(SEEDS),
        },
        "rates": found,
        "workloads": {},
    }
    verdicts: list[str] = []
    for w in order:
        by_seed = rows[w]
        lacking = missing(w, by_seed)
        if lacking:
            lines += ["", f"## {w}", "", f"Incomplete, not judged: no {', '.join(lacking)}."]
            verdicts.append(f"| {w} | every goal | incomplete |")
            continue
        best = best_fixed(by_seed[SEEDS[0]])
        cols = {c: [by_seed[s][c] for s in SEEDS if c in by_seed[s]] for c in ALL_SEEDS}
        cols["best-fixed"] = [best]
        rr50 = _mean(cols["round-robin"], "ttft_p50_s")
        rr99 = _mean(cols["round-robin"], "ttft_p99_s")
        checks = seed_goals(w, by_seed)
        lines += [
            "",
            f"## {w}",
            "",
            f"Rate {found[w]['rate']:g} req/s. Means over seeds {', '.join(map(str, SEEDS))}; "
            f"best fixed key: seed {SEEDS[0]}'s, {best['label'].removeprefix('fixed-')} bytes.",
            "",
            "| | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
            *(
                f"| {name} | " + " | ".join(fmt(v, rr50, rr99) for v in cols.values()) + " |"
                for name, fmt in METRICS
            ),
            *goal_table(checks, "figures by seed"),
        ]
        verdicts += [f"| {w} | {g} | {_verdict(ok)} |" for g, ok, _ in checks if ok is not None]
        summary["workloads"][w] = {
            "seeds": {str(s): by_seed[s] for s in SEEDS},
            "best_fixed": best["label"],
            "goals": goals_json(checks),
        }
    lines += [
        "",
        "## Goals (product defaults; every seed but the fixed-key goal, seed 1's)",
        "",
        "| workload | goal | verdict |",
        "|---|---|---|",
        *verdicts,
        "",
    ]
    return write_report(out, lines, summary)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=("calibrate", "run", "capacity", "report"))
    parser.add_argument("--only", default=",".join(RATES), help="comma-separated workloads")
    parser.add_argument("--variants", default="", help="run: only these labels")
    parser.add_argument("--jobs", type=int, default=1, help="processes")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    chosen = [w for w in args.only.split(",") if w]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "calibrate":
        found = rates(args.out)
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for w, result in zip(
                chosen, pool.map(capacity, chosen, [STARTS[w] for w in chosen]), strict=True
            ):
                found[w] = result
                (args.out / "rates.json").write_text(json.dumps(found, indent=1) + "\n")
                print(f"{w}: RR capacity {result['capacity']:g} -> rate {result['rate']:g}")
    elif args.part == "capacity":
        found = rates(args.out)
        lacking = [w for w in chosen if w not in found]
        if lacking:
            parser.error(f"no calibrated rate for {', '.join(lacking)}: run calibrate first")
        path = args.out / DEFAULTS_CAPACITY
        done = json.loads(path.read_text()) if path.exists() else {}
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = pool.map(defaults_capacity, chosen, [found[w]["capacity"] for w in chosen])
            for w, result in zip(chosen, results, strict=True):
                done[w] = result
                path.write_text(json.dumps(done, indent=1) + "\n")
                print(f"{w}: defaults {result['capacity']:g} req/s, RR {result['round_robin']:g}")
    elif args.part == "run":
        found = rates(args.out)
        missing = [w for w in chosen if w not in found]
        if missing:
            parser.error(f"no calibrated rate for {', '.join(missing)}: run calibrate first")
        labels = set(filter(None, args.variants.split(",")))
        todo = plan(chosen, labels)
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [
                pool.submit(_run_and_save, args.out, w, found[w]["rate"], v, s) for w, v, s in todo
            ]
            for f in futures:
                print(f.result(), flush=True)
    print(report(args.out))


if __name__ == "__main__":
    main()
