"""Issue 23's figures: every policy with its defaults on every workload, in one run each.

    flock /tmp/prefix-router-heavy.lock python bench/scripts/routing_defaults.py run
    python bench/scripts/routing_defaults.py calibrate --only rag  # rate: RR ~60% busy
    python bench/scripts/routing_defaults.py old --out DIR         # in a worktree of e67dc7e
    python bench/scripts/routing_defaults.py floor                 # the engine's own floor
    python bench/scripts/routing_defaults.py report                # report.md, summary.json

``run`` simulates (bench/des.py) 8 Llama-3.1-70B-like instances (460K-token KV cache,
12K prompt tokens/s, ~20 ms per decode step) under round robin, least-request, the
cache-aware comparator (bench/cache_aware.py, SGLang's defaults), ``prefix`` (the defaults
without spill), ``prefix-spill`` (the product's defaults), ``prefix-fixed`` (a fixed 1 KiB
key) and a fixed key of 4, 8, 16 and 32 KiB (the best of the five is the hand-tuned
key). Each run's figures go to ``runs/<workload>/<label>.json``; ``report`` checks issue
23's goals and writes ``report.md`` and ``summary.json``.

``old`` runs the same workloads and rates under the ``prefix-spill`` policy of the code it
is run in (for the round-1 router: copy this script and bench/workloads.py into a worktree
of e67dc7e, uncommitted); ``report`` adds those figures as a column when
``runs/<workload>/e67dc7e.json`` exist.

``floor`` runs the workloads with a P50 goal once more with prefill free (the instances
compute prompts at 10^12 tokens/s, everything else as before): what is left is the engine's
own TTFT at that load (the step under way, then its own step's overhead and decode work),
a floor no router goes below. ``report`` calls the P50 goal unreachable where 0.3 x round
robin's P50 is under it.

Rates come from :data:`RATES`: for each workload the rate at which round robin keeps the
instances 55-65% busy with prefill (prompt tokens computed for the requests sent between
the 5th and the 95th percentile of arrival times / (instances x 12K tokens/s x that time):
the load while it lasts, not the ramp of a conversation's first and last turns), found
with ``calibrate`` (a secant search over RR runs); the report prints the busy fraction
each full RR run measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.des import DesSettings, simulate  # noqa: E402
from bench.policies import Policy  # noqa: E402
from bench.results import RunResult  # noqa: E402
from bench.workloads import generate  # noqa: E402
from prefix_router.core.config import RouterConfig  # noqa: E402
from vllm_sim.config import make_config  # noqa: E402

OUT = ROOT / "bench" / "results" / "routing-defaults"
INSTANCES = 8
NUM_GPU_BLOCKS = 28_750
"""460K tokens of KV cache per instance (16-token blocks)."""
PREFILL_TOKENS_PER_S = 12_000.0
BUSY_TARGET = (0.55, 0.65)
FIXED_LENGTHS = (1024, 4096, 8192, 16384, 32768)
OLD = "e67dc7e"
"""The round-1 router (fixed 1 KiB key, threshold on requests in flight)."""
FLOOR = "engine-floor"
"""The run with prefill free (``floor``): the engine's own TTFT at the workload's load."""
FREE_PREFILL_TOKENS_PER_S = 1e12

SCALE: dict[str, dict[str, int | float]] = {
    "system-prompt": {"prompts": 168},
    "rag": {"docs": 336},
    "code": {"files": 168},
    "hot-prefix": {"prompts": 168},
    "mixed": {"pool_scale": 3.5},
}
"""The six older workloads were sized for instances of 131K KV tokens; here each holds
460K (3.5x), so their pools of prompts, documents and files are 3.5x larger: what one
instance can cache relative to the working set stays as it was (otherwise every instance
caches everything and round robin needs no router)."""

RATES: dict[str, float] = {
    "system-prompt": 14.89,
    "rag": 20.0,
    "chat": 370.0,
    "code": 39.76,
    "unique": 16.65,
    "hot-prefix": 14.71,
    "long-system-chat": 300.0,
    "trace-like": 30.0,
    "group-prompts": 27.76,
    "mixed": 22.0,
}
"""Requests per second at which round robin keeps the 8 instances 55-65% busy with
prefill (``calibrate``; the report prints what each full RR run measured). Two cannot
get there: long-system-chat's busy fraction levels off at ~34% and chat's at ~52% however
fast conversations arrive (all 800 / 1,100 conversations at once: the instances are then
busy decoding ~100 answers each, and a step's decode time, not prefill, sets the pace),
so they run near that ceiling."""

REQUESTS = {
    "system-prompt": 3000,
    "rag": 3000,
    "chat": 6000,
    "code": 3000,
    "unique": 2000,
    "hot-prefix": 3000,
    "long-system-chat": 4800,
    "trace-like": 6000,
    "mixed": 6000,
}
"""Requests per run (group-prompts: its 2,048)."""

THINK = {
    "chat": {"think_mean_s": 2.0},
    "long-system-chat": {"think_mean_s": 2.0},
    "trace-like": {"think_mean_s": 4.0},
    "mixed": {"think_mean_s": 4.0},
}
"""Conversations with their default think times (10-20 s) send a turn every 15-30 s, and
the fleet is busy only with many at once: 600 conversations of long-system-chat kept these
8 instances at most 17% busy however fast they arrived, 1,600 chats (9,000 requests) at
most 35% (measured over the whole span of arrivals). Shorter think times reach 55-65%
with runs the machine can afford (800 conversations of 6 turns, ~1,100 chats); the caches
are large enough that a turn's wait changes nothing else."""

SHARED = (
    "system-prompt",
    "rag",
    "chat",
    "code",
    "hot-prefix",
    "long-system-chat",
    "trace-like",
    "group-prompts",
    "mixed",
)
"""Workloads whose requests share prefixes (the hit-rate goal applies)."""
P50_GOAL = ("long-system-chat", "rag", "trace-like", "system-prompt", "group-prompts")
"""Where shared prefixes are most of the prompt: P50 TTFT <= 0.3 x round robin's."""
ONE_PREFIX_EXCEEDS = ("hot-prefix",)
"""Half the requests on one prompt: its uncached prefill alone is ~2.4 instances' worth at
the calibrated rate, so no router can keep that instance at 1.25 x the mean share."""


@dataclass(frozen=True)
class Variant:
    label: str
    policy: str
    router: Mapping[str, Any] = field(default_factory=dict)


VARIANTS = (
    Variant("round-robin", "round-robin"),
    Variant("least-request", "least-request"),
    Variant("cache-aware", "cache-aware"),
    Variant("prefix", "prefix"),
    Variant("prefix-spill", "prefix-spill"),
    *(
        Variant(f"fixed-{n}", "prefix-spill", {"prefix_match": "fixed", "prefix_length": n})
        for n in FIXED_LENGTHS
    ),
)
"""``fixed-1024`` is ``prefix-fixed`` (the defaults with a fixed 1 KiB key)."""


def overrides(workload: str, rate: float, requests: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {**SCALE.get(workload, {}), **THINK.get(workload, {}), "rate": rate}
    n = requests or REQUESTS.get(workload)
    if n:
        out["requests"] = n
    return out


def simulate_one(
    workload: str,
    rate: float,
    variant: Variant,
    requests: int | None = None,
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S,
) -> dict[str, Any]:
    """One run's figures (see :func:`figures`)."""
    engine = make_config(num_gpu_blocks=NUM_GPU_BLOCKS, prefill_tokens_per_s=prefill_tokens_per_s)
    router = RouterConfig().patched(dict(variant.router)) if variant.router else RouterConfig()
    settings = DesSettings(
        policy=Policy(variant.policy), engine=engine, router=router, instances=INSTANCES
    )
    started = time.perf_counter()
    result = simulate(generate(workload, overrides(workload, rate, requests)), settings)
    out = figures(result)
    out.update(
        workload=workload,
        label=variant.label,
        policy=variant.policy,
        router=dict(variant.router),
        rate=rate,
        cpu_s=time.perf_counter() - started,
    )
    return out


def figures(
    result: RunResult, prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
) -> dict[str, Any]:
    ok = result.ok
    arrivals = sorted(r.arrival_s for r in result.records)
    start, end = arrivals[len(arrivals) // 20], arrivals[-len(arrivals) // 20]
    computed = sum(
        r.prompt_tokens - (r.cached_tokens or 0) for r in ok if start <= r.arrival_s <= end
    )
    shares = [i.requests for i in result.instances]
    bounds = result.bounds
    return {
        "requests": len(result.records),
        "errors": result.errors,
        "hit_rate": result.hit_rate,
        "fleet_lru": bounds.fleet_lru if bounds else None,
        "infinite": bounds.infinite if bounds else None,
        "ttft_p50_s": result.ttft(50),
        "ttft_p99_s": result.ttft(99),
        "max_share": max(shares) / statistics.fmean(shares),
        "prefill_busy": computed / (len(shares) * prefill_tokens_per_s * (end - start)),
        "engine_busy": result.mean_busy,
    }


def run_path(out: Path, workload: str, label: str) -> Path:
    return out / "runs" / workload / f"{label}.json"


def save(out: Path, row: dict[str, Any]) -> None:
    path = run_path(out, row["workload"], row["label"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1) + "\n")
    print(
        f"{row['workload']:>16} {row['label']:>14}: hit {row['hit_rate']:.3f} "
        f"(LRU {row['fleet_lru']:.3f}) P50 {row['ttft_p50_s'] * 1000:.0f} ms "
        f"P99 {row['ttft_p99_s'] * 1000:.0f} ms share {row['max_share']:.2f} "
        f"busy {row['prefill_busy']:.2f} errors {row['errors']} ({row['cpu_s']:.0f} s)",
        flush=True,
    )


def calibrate(workload: str, rate: float, requests: int | None) -> float:
    """The rate at which round robin is ~60% busy with prefill (secant on the rate)."""
    rr = VARIANTS[0]
    points: list[tuple[float, float]] = []
    for _ in range(4):
        busy = simulate_one(workload, rate, rr, requests)["prefill_busy"]
        print(f"{workload}: rate {rate:.2f} -> RR prefill busy {busy:.3f}", flush=True)
        points.append((rate, busy))
        if BUSY_TARGET[0] + 0.01 <= busy <= BUSY_TARGET[1] - 0.01:
            return rate
        if len(points) >= 2 and points[-1][1] != points[-2][1]:
            (r0, b0), (r1, b1) = points[-2:]
            rate = max(rate / 3, min(rate * 3, r1 + (0.6 - b1) * (r1 - r0) / (b1 - b0)))
        else:
            rate = rate * 0.6 / max(busy, 0.02)
    return rate


# -- report -------------------------------------------------------------------------------


def load(out: Path) -> dict[str, dict[str, dict[str, Any]]]:
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted((out / "runs").glob("*/*.json")):
        row = json.loads(path.read_text())
        rows.setdefault(row["workload"], {})[row["label"]] = row
    return rows


def best_fixed(runs: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The hand-tuned key: the fixed length with the lowest P50 TTFT."""
    fixed = [runs[f"fixed-{n}"] for n in FIXED_LENGTHS if f"fixed-{n}" in runs]
    return min(fixed, key=lambda r: r["ttft_p50_s"])


Outcome = bool | None | Literal["unreachable"]
"""A goal's outcome: passed, failed, None where it does not apply, or ``"unreachable"``
(missed where no router can meet it: :func:`_p50_goal`)."""
Goal = tuple[str, Outcome, str]


def goals(
    workload: str,
    runs: Mapping[str, dict[str, Any]],
    label: str,
    one_prefix_exceeds: Collection[str] = ONE_PREFIX_EXCEEDS,
) -> list[Goal]:
    """``(goal, passed or None when it does not apply, figures)`` for ``runs[label]``;
    the share goal does not apply to ``one_prefix_exceeds``."""
    r, rr = runs[label], runs["round-robin"]
    best = best_fixed(runs)
    ratio = r["hit_rate"] / r["fleet_lru"] if r["fleet_lru"] else float("nan")
    out: list[Goal] = [
        (
            "hit >= 0.95 x fleet-LRU",
            ratio >= 0.95 if workload in SHARED else None,
            f"{r['hit_rate']:.3f} / {r['fleet_lru']:.3f} = {ratio:.2f}",
        ),
        _p50_goal(workload, r, rr, runs.get(FLOOR)),
        (
            "P50 <= best fixed key",
            round(r["ttft_p50_s"], 3) <= round(best["ttft_p50_s"], 3),
            f"{_ms(r['ttft_p50_s'])} vs {_ms(best['ttft_p50_s'])} ({best['label']})",
        ),
        (
            "P99 <= RR",
            r["ttft_p99_s"] <= rr["ttft_p99_s"],
            f"{_ms(r['ttft_p99_s'])} vs {_ms(rr['ttft_p99_s'])}",
        ),
        (
            "max share <= 1.25",
            r["max_share"] <= 1.25 if workload not in one_prefix_exceeds else None,
            f"{r['max_share']:.2f}",
        ),
        ("no errors", r["errors"] == 0, str(r["errors"])),
    ]
    return out


UNREACHABLE: Literal["unreachable"] = "unreachable"


def _p50_goal(
    workload: str, r: Mapping[str, Any], rr: Mapping[str, Any], floor: Mapping[str, Any] | None
) -> Goal:
    """P50 <= 0.3 x round robin's, where shared prefixes are most of the prompt; missed
    where that is under a floor no router goes under: :data:`UNREACHABLE`. Two floors: the
    engine's at the load (:data:`FLOOR`, a run with prefill free: queues and steps only),
    and the requests' own (``ttft_floor_p50_s``, when the run recorded it: each request's
    prefill of what no cache could hold, alone in one step). The second bounds this run's
    requests; in a conversation workload the next turn is sent after the answer, so which
    turns fall in the window moves a little with the router."""
    figures = f"{r['ttft_p50_s'] / rr['ttft_p50_s']:.2f} x RR"
    target = 0.3 * rr["ttft_p50_s"]
    if workload not in P50_GOAL:
        return ("P50 <= 0.3 x RR", None, figures)
    if r["ttft_p50_s"] > target:
        if floor is not None and floor["ttft_p50_s"] > target:
            figures += (
                f"; 0.3 x RR = {_ms(target)} is under the engine's floor, "
                f"{_ms(floor['ttft_p50_s'])} with prefill free: no router reaches it"
            )
            return ("P50 <= 0.3 x RR", UNREACHABLE, figures)
        own = r.get("ttft_floor_p50_s")
        if own is not None and own > target:
            figures += (
                f"; 0.3 x RR = {_ms(target)} is under the requests' own floor, "
                f"{_ms(own)} to prefill what no cache could hold: no router reaches it "
                "on these requests"
            )
            return ("P50 <= 0.3 x RR", UNREACHABLE, figures)
    return ("P50 <= 0.3 x RR", r["ttft_p50_s"] <= target, figures)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def _verdict(ok: Outcome) -> str:
    if ok is None or ok == UNREACHABLE:
        return "n/a" if ok is None else UNREACHABLE
    return "PASS" if ok else "**FAIL**"


COLUMNS = (
    "round-robin",
    "least-request",
    "cache-aware",
    "prefix",
    "prefix-spill",
    "fixed-1024",
    "best-fixed",
    OLD,
)


def report(out: Path) -> Path:
    rows = load(out)
    order = [w for w in RATES if w in rows]
    lines = [
        "# Routing with its defaults (issue 23, items 3 and 4)",
        "",
        f"Discrete-event simulation (bench/des.py) of {INSTANCES} Llama-3.1-70B-like instances: "
        f"{NUM_GPU_BLOCKS:,} KV blocks of 16 tokens (460K tokens) each, "
        f"{PREFILL_TOKENS_PER_S:,.0f} prompt tokens/s, ~20 ms per decode step. "
        "Every router with its defaults; nothing tuned per workload. "
        "Reproduce: `flock /tmp/prefix-router-heavy.lock python "
        "bench/scripts/routing_defaults.py run` (see bench/README.md).",
        "",
        "Columns: `prefix-spill` is the product's defaults; `prefix` the same without spill; "
        "`fixed-1024` the defaults with a fixed 1 KiB key (`prefix-fixed`); `best-fixed` the "
        "fixed key of 1, 4, 8, 16 or 32 KiB with the lowest P50 TTFT on that workload (the "
        "hand-tuned key); `cache-aware` SGLang model gateway's cache_aware policy with its "
        f"defaults (bench/cache_aware.py); `{OLD}` the round-1 router's prefix-spill (fixed "
        f"1 KiB key, ConcurrencyThreshold 16 counting requests in flight), run from a worktree "
        f"of commit {OLD} on the same workloads and rates.",
        "",
        "## Rates",
        "",
        "| workload | requests | rate (req/s) | RR prefill busy | in 55-65% |",
        "|---|---|---|---|---|",
    ]
    for w in order:
        rr = rows[w].get("round-robin")
        if rr:
            b = rr["prefill_busy"]
            inside = BUSY_TARGET[0] <= b <= BUSY_TARGET[1]
            lines.append(
                f"| {w} | {rr['requests']} | {rr['rate']:g} | {b:.1%} | "
                f"{'yes' if inside else '**no**'} |"
            )
    metrics: list[tuple[str, Callable[[dict[str, Any], dict[str, Any]], str]]] = [
        ("token hit rate", lambda r, _: f"{r['hit_rate']:.3f}"),
        (
            "hit / fleet-LRU bound",
            lambda r, _: f"{r['hit_rate'] / r['fleet_lru']:.2f}" if r["fleet_lru"] else "n/a",
        ),
        ("P50 TTFT", lambda r, _: _ms(r["ttft_p50_s"])),
        ("P50 / RR", lambda r, rr: f"{r['ttft_p50_s'] / rr['ttft_p50_s']:.2f}"),
        ("P99 TTFT", lambda r, _: _ms(r["ttft_p99_s"])),
        ("P99 / RR", lambda r, rr: f"{r['ttft_p99_s'] / rr['ttft_p99_s']:.2f}"),
        ("max share / mean", lambda r, _: f"{r['max_share']:.2f}"),
        ("errors", lambda r, _: str(r["errors"])),
    ]
    summary: dict[str, Any] = {
        "settings": {
            "instances": INSTANCES,
            "num_gpu_blocks": NUM_GPU_BLOCKS,
            "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        },
        "workloads": {},
    }
    verdicts: list[str] = []
    for w in order:
        runs = dict(rows[w])
        if "round-robin" not in runs or not any(k.startswith("fixed-") for k in runs):
            continue
        best = best_fixed(runs)
        runs["best-fixed"] = best
        cols = [c for c in COLUMNS if c in runs]
        lines += [
            "",
            f"## {w}",
            "",
            f"Rate {runs['round-robin']['rate']:g} req/s; best fixed key: "
            f"{best['label'].removeprefix('fixed-')} bytes "
            f"(P50 by length: "
            + ", ".join(
                f"{n}: {_ms(runs[f'fixed-{n}']['ttft_p50_s'])}"
                for n in FIXED_LENGTHS
                if f"fixed-{n}" in runs
            )
            + ").",
            "",
            "| | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        rr = runs["round-robin"]
        for name, fmt in metrics:
            lines.append(f"| {name} | " + " | ".join(fmt(runs[c], rr) for c in cols) + " |")
        checks = goals(w, runs, "prefix-spill")
        lines += goal_table(checks)
        verdicts += [
            f"| {w} | {g} | {_verdict(ok)} | {fig} |" for g, ok, fig in checks if ok is not None
        ]
        summary["workloads"][w] = {
            "runs": runs,
            "best_fixed": best["label"],
            "goals": goals_json(checks),
        }
    lines += [
        "",
        "## Goals of issue 23 item 4 (product defaults)",
        "",
        "| workload | goal | verdict | figures |",
        "|---|---|---|---|",
        *verdicts,
        "",
    ]
    return write_report(out, lines, summary)


def goal_table(checks: list[Goal], figures: str = "figures") -> list[str]:
    """A workload's goals as a markdown table (after a blank line)."""
    return [
        "",
        f"| goal (prefix-spill) | verdict | {figures} |",
        "|---|---|---|",
        *(f"| {g} | {_verdict(ok)} | {fig} |" for g, ok, fig in checks),
    ]


def goals_json(checks: list[Goal]) -> list[dict[str, Any]]:
    return [{"goal": g, "pass": ok, "figures": fig} for g, ok, fig in checks]


def write_report(out: Path, lines: list[str], summary: Mapping[str, Any]) -> Path:
    """``out/report.md`` (``lines``, then ``out/notes.md``: findings written by hand, why a
    goal fails, measured) and ``out/summary.json``; the report's path."""
    notes = out / "notes.md"
    if notes.exists():
        lines = [*lines, notes.read_text()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=("run", "calibrate", "old", "floor", "report"))
    parser.add_argument("--only", default=",".join(RATES), help="comma-separated workloads")
    parser.add_argument("--variants", default="", help="run: only these labels")
    parser.add_argument("--requests", type=int, help="calibrate: requests per short run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    chosen = [w for w in args.only.split(",") if w]
    if args.part == "calibrate":
        found = {w: calibrate(w, RATES[w], args.requests) for w in chosen}
        print(json.dumps({w: round(r, 2) for w, r in found.items()}, indent=1))
        return
    if args.part == "run":
        labels = set(filter(None, args.variants.split(",")))
        for w in chosen:
            for v in VARIANTS:
                if not labels or v.label in labels:
                    save(args.out, simulate_one(w, RATES[w], v))
    elif args.part == "floor":
        for w in chosen:
            if w in P50_GOAL:
                variant = Variant(FLOOR, "prefix-spill")
                save(args.out, simulate_one(w, RATES[w], variant, None, FREE_PREFILL_TOKENS_PER_S))
    elif args.part == "old":
        for w in chosen:
            row = simulate_one(w, RATES[w], Variant(OLD, "prefix-spill"))
            save(args.out, row)
        return
    print(report(args.out))


if __name__ == "__main__":
    main()
