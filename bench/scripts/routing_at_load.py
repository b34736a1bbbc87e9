"""Issue 23's goals again, at a load measured where it can fail us: every router with its
defaults on every workload, heavy-tailed and bursty, on instances sized as the facts file's
Llama-3.1-70B, at 60% of round robin's own capacity, on three seeds.

    flock /tmp/prefix-router-heavy.lock python bench/scripts/routing_at_load.py calibrate
    flock /tmp/prefix-router-heavy.lock python bench/scripts/routing_at_load.py run --jobs 2
    python bench/scripts/routing_at_load.py report    # report.md, summary.json

Why a second benchmark: ``routing_defaults.py`` (the figures issue 23 was resolved on)
chose each rate where round robin was "55-65% busy with prefill", uncached prompt tokens
over the fleet's prefill rate. That measure leaves out decode and per-step time and barely
moves with the rate on conversation workloads, so on some rows round robin ran past
saturation (mixed: P99 41 s and growing with the run's length) and every "x round robin"
ratio there is flattered. Six of its ten workloads also kept uniform 64-256-token outputs
and Poisson arrivals, and its instances were slower and smaller than the facts' 70B.

What this one changes:

**Load.** ``calibrate`` finds round robin's capacity on each workload: the highest rate at
which it keeps up, measured over the second half of a run (requests completed per second
at least 95% of the offered rate, and P99 TTFT under 30 s: a queue that has not run away);
a search over rates (bench/capacity.py) to 5%. ``run`` offers :data:`LOAD` (60%) of that
rate: round robin is 60% busy in the queueing sense, load over what it can serve. Each
run records round robin's P99 over the first and second halves of the arrivals, so the
report shows that its queue did not grow.

**Traffic.** Every workload has lognormal outputs (median 256 tokens, log deviation 1,
capped at 4,096: 1% above ~2,600; code completion and the hot prefix median 48) and gamma
arrivals with coefficient of variation 2 (clumps; the count in a window varies ~4x
Poisson's).

**Instances.** The simulator's ``llama-3.1-70b-8xh100`` profile, as vllm-facts.md gives it:
81,000 KV blocks of 16 (1.3M tokens), 22,000 prompt tokens/s, 17 ms a step. Pools of
shared prompts are scaled with the cache (2.8x ``routing_defaults.py``'s) so what one
instance caches relative to the working set stays as it was there.

**Seeds.** Round robin, least-request, the cache-aware comparator and the product's
defaults run on seeds 1-3 (workload and simulation); the fixed keys and ``prefix``
(defaults without spill) on seed 1. A goal passes only when it passes on every seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.capacity import (  # noqa: E402
    Objective,
    ProbeSetup,
    RunPlan,
    SearchSettings,
    find_capacity,
)
from bench.des import DesSettings, simulate  # noqa: E402
from bench.policies import Policy  # noqa: E402
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
    goals,
)
from bench.workloads import generate  # noqa: E402
from prefix_router.core.config import RouterConfig  # noqa: E402
from vllm_sim.config import make_config  # noqa: E402

OUT = ROOT / "bench" / "results" / "routing-at-load"
ENGINE = make_config()
"""The ``llama-3.1-70b-8xh100`` profile: 81,000 blocks, 22,000 prompt tokens/s, t0 17 ms."""
LOAD = 0.6
"""Offered rate over round robin's capacity."""
CAPACITY_OBJECTIVE = Objective(p50_s=1e9, p99_s=30.0, min_served=0.95)
"""Round robin keeps up: completions >= 95% of the offered rate, P99 under 30 s."""
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


def overrides(workload: str, rate: float, seed: int) -> dict[str, str | int | float]:
    """The workload's parameters here: scaled pools, think times, shape, rate and seed."""
    out: dict[str, str | int | float] = {
        k: (v * POOL_RATIO if k == "pool_scale" else max(1, round(v * POOL_RATIO)))
        for k, v in SCALE.get(workload, {}).items()
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
        warmup=0.5,
    )


# -- calibrate ----------------------------------------------------------------------------


def capacity(workload: str, start: float) -> dict[str, Any]:
    """Round robin's capacity on ``workload`` (seed 1), with every probe of the search."""
    base = overrides(workload, start, 1)
    fixed = {k: v for k, v in base.items() if k not in ("rate", "seed", "requests")}
    setup = ProbeSetup(
        workload=workload,
        overrides=tuple(sorted(fixed.items())),
        policy=Policy.ROUND_ROBIN,
        engine=ENGINE,
        router=RouterConfig(),
        plan=run_plan(workload),
        objective=CAPACITY_OBJECTIVE,
    )
    found = find_capacity(
        setup, INSTANCES, SearchSettings(start=start, seeds=(1,), precision=0.05), verbose=True
    )
    if found.search.lo is None:
        raise SystemExit(f"{workload}: round robin keeps up at no rate tried")
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


def rates(out: Path) -> dict[str, dict[str, Any]]:
    path = out / "rates.json"
    return json.loads(path.read_text()) if path.exists() else {}


# -- run ----------------------------------------------------------------------------------


def simulate_one(workload: str, rate: float, variant: Variant, seed: int) -> dict[str, Any]:
    """One run's figures (``routing_defaults.figures``) plus round robin's drift check."""
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
    result = simulate(generate(workload, overrides(workload, rate, seed)), settings)
    row = figures(result, ENGINE.cost.prefill_tokens_per_s)
    arrivals = sorted(r.arrival_s for r in result.records)
    middle = arrivals[len(arrivals) // 2]
    halves = [
        sorted(
            r.ttft_s for r in result.ok if r.ttft_s is not None and (r.arrival_s < middle) == early
        )
        for early in (True, False)
    ]
    row.update(
        workload=workload,
        label=variant.label,
        policy=variant.policy,
        router=dict(variant.router),
        rate=rate,
        seed=seed,
        ttft_p99_halves_s=[_p(h, 99) for h in halves],
        cpu_s=time.process_time() - started,
    )
    return row


def _p(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


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


COLUMNS = ("round-robin", "least-request", "cache-aware", "prefix-spill", "best-fixed")


def _mean(runs: Sequence[Mapping[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def seed_goals(
    workload: str, by_seed: Mapping[int, Mapping[str, dict[str, Any]]]
) -> list[tuple[str, Outcome, str]]:
    """Each goal of ``routing_defaults.goals`` on every seed: passed only when every seed
    passed, ``unreachable`` when it was on some seed and passed on the others; the fixed
    keys and the engine's floor are seed 1's (the only seed they run on)."""
    first = by_seed[min(by_seed)]
    fixed = {k: v for k, v in first.items() if k.startswith("fixed-") or k == FLOOR}
    per_seed = []
    for runs in by_seed.values():
        if "prefix-spill" in runs and "round-robin" in runs:
            per_seed.append(goals(workload, {**fixed, **runs}, "prefix-spill"))
    out: list[tuple[str, Outcome, str]] = []
    for i, (name, _, _) in enumerate(per_seed[0]):
        results = [s[i][1] for s in per_seed]
        figs = " / ".join(s[i][2] for s in per_seed)
        if all(r is None for r in results):
            out.append((name, None, figs))
        elif all(r in (True, UNREACHABLE) for r in results) and UNREACHABLE in results:
            out.append((name, UNREACHABLE, figs))
        else:
            out.append((name, all(r is True for r in results), figs))
    return out


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
        "outputs and bursty arrivals; every router with its defaults. Reproduce and read "
        "the method: `bench/scripts/routing_at_load.py` (its docstring).",
        "",
        "## Load",
        "",
        "Round robin's capacity (keeps up: completed >= 95% of offered in the second half "
        "of a run, P99 TTFT <= 30 s), the rate offered (60% of it), and round robin's P99 "
        "TTFT over the first and second halves of the arrivals at that rate (seed by seed: "
        "a queue that grows shows as a second half far above the first).",
        "",
        "| workload | RR capacity (req/s) | first failing | rate offered "
        "| RR P99 first / second half |",
        "|---|---|---|---|---|",
    ]
    for w in order:
        cal = found.get(w, {})
        halves = ", ".join(
            f"{_ms(r['ttft_p99_halves_s'][0])} / {_ms(r['ttft_p99_halves_s'][1])}"
            for s, r in sorted(
                (s, runs["round-robin"]) for s, runs in rows[w].items() if "round-robin" in runs
            )
        )
        lines.append(
            f"| {w} | {cal.get('capacity', float('nan')):g} | {cal.get('failed_at', '')} | "
            f"{cal.get('rate', float('nan')):g} | {halves} |"
        )
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
        seeds = sorted(s for s, runs in by_seed.items() if "round-robin" in runs)
        if not seeds or not any(k.startswith("fixed-") for k in by_seed[seeds[0]]):
            continue
        best = best_fixed(by_seed[seeds[0]])
        cols: dict[str, list[dict[str, Any]]] = {
            c: [by_seed[s][c] for s in seeds if c in by_seed[s]] for c in COLUMNS[:-1]
        }
        cols["best-fixed"] = [best]
        cols = {c: v for c, v in cols.items() if v}
        rr50, rr99 = (
            _mean(cols["round-robin"], "ttft_p50_s"),
            _mean(cols["round-robin"], "ttft_p99_s"),
        )
        lines += [
            "",
            f"## {w}",
            "",
            f"Means over seeds {', '.join(map(str, seeds))} (best fixed key: seed 1's, "
            f"{best['label'].removeprefix('fixed-')} bytes).",
            "",
            "| | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
            "| token hit rate | "
            + " | ".join(f"{_mean(v, 'hit_rate'):.3f}" for v in cols.values())
            + " |",
            "| P50 TTFT | " + " | ".join(_ms(_mean(v, "ttft_p50_s")) for v in cols.values()) + " |",
            "| P50 / RR | "
            + " | ".join(f"{_mean(v, 'ttft_p50_s') / rr50:.2f}" for v in cols.values())
            + " |",
            "| P99 TTFT | " + " | ".join(_ms(_mean(v, "ttft_p99_s")) for v in cols.values()) + " |",
            "| P99 / RR | "
            + " | ".join(f"{_mean(v, 'ttft_p99_s') / rr99:.2f}" for v in cols.values())
            + " |",
            "| max share / mean | "
            + " | ".join(f"{max(r['max_share'] for r in v):.2f}" for v in cols.values())
            + " |",
            "| errors | "
            + " | ".join(str(sum(r["errors"] for r in v)) for v in cols.values())
            + " |",
        ]
        checks = seed_goals(w, {s: by_seed[s] for s in seeds})
        lines += [
            "",
            "| goal (prefix-spill, every seed) | verdict | figures by seed |",
            "|---|---|---|",
        ]
        lines += [f"| {g} | {_verdict(ok)} | {fig} |" for g, ok, fig in checks]
        verdicts += [f"| {w} | {g} | {_verdict(ok)} |" for g, ok, _ in checks if ok is not None]
        summary["workloads"][w] = {
            "seeds": {str(s): by_seed[s] for s in seeds},
            "best_fixed": best["label"],
            "goals": [{"goal": g, "pass": ok, "figures": fig} for g, ok, fig in checks],
        }
    lines += [
        "",
        "## Goals (product defaults, every seed)",
        "",
        "| workload | goal | verdict |",
        "|---|---|---|",
        *verdicts,
        "",
    ]
    notes = out / "notes.md"
    if notes.exists():
        lines += [notes.read_text()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=("calibrate", "run", "report"))
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
