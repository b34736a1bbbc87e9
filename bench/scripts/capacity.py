"""Reproduce bench/results/capacity: capacity at a TTFT objective, per policy and workload.

    python bench/scripts/capacity.py sweep    # every workload x policy in the DES (~45 min)
    python bench/scripts/capacity.py live     # knees on 2 instances, live vs the DES
    python bench/scripts/capacity.py report   # rebuild report.md and the PNGs

``sweep --only rag,unique`` runs a subset (the others' results are kept); ``--jobs 2`` (the
default) searches two policies at a time. Run it under the heavy-run lock on a shared
machine: ``flock /tmp/prefix-router-heavy.lock python bench/scripts/capacity.py sweep``.
Every step is a ``prefix-router bench`` command, printed before it runs.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (results are written under ``bench/results``)."""

from bench.cli import main as bench  # noqa: E402
from bench.scripts.routing_defaults import (  # noqa: E402
    NUM_GPU_BLOCKS,
    PREFILL_TOKENS_PER_S,
    SCALE,
    THINK,
)
from bench.workloads import WORKLOADS as KNOWN  # noqa: E402

OUT = ROOT / "bench" / "results" / "capacity"
LIVE = OUT / "live"
KNEE = OUT / "live-knee"

FLEET = ["--instances", "8", "--num-gpu-blocks", "28750", "--prefill-tokens-per-s", "12000"]
"""Eight Llama-3.1-70B / 8xH100 instances with 460k tokens of KV cache each (28,750 blocks
of 16) and a prefill rate of 12,000 tokens/s: the fleet every capacity figure is for."""

SINGLE_TURN = ["--run-requests", "5000", "--min-duration", "60", "--warmup", "0.5"]
"""5,000 requests and 60 model seconds a run, the first half not measured: every prompt has
been placed (168 prompts need ~1,000 requests to all appear once) and each instance's cache
has turned over, so the 2,500 measured are in steady state (prefix-spill, system prompts at
30 requests/s: 89.6% hit rate and P99 1,070 ms in the window, 90.0% and 1,047 ms in a
9,000-request run; 2,000-request runs measured the warm-up and failed); and a request
decoding hundreds of tokens on a busy instance takes 10-30 s, so the 30 s of warm-up let
completions catch up with arrivals before the window checks that they keep up."""
MULTI_TURN = ["--run-requests", "3000", "--min-duration", "300", "--warmup", "0.5", "--seeds", "2"]
"""At least 300 s of new conversations, the first half not measured, two seeds. A turn is
sent only after the last one's answer, so a conversation lives six turns of 10-40 s each
near the knee (long-system-chat: e2e P50 17 s with prefix-spill, 37 s with round robin at
70 turns/s); with 100 s runs the window saw the fleet still filling, and the turns sent
into it were 45-70% of the offered rate at every rate tried."""


def scaled(workload: str) -> list[str]:
    """The workload as bench/scripts/routing_defaults.py sizes it for these instances."""
    return [
        arg
        for k, v in {**SCALE.get(workload, {}), **THINK.get(workload, {})}.items()
        for arg in ("--set", f"{k}={v}")
    ]


WORKLOADS: dict[str, list[str]] = {
    "system-prompt": [*SINGLE_TURN, "--start", "2,prefix=150,prefix-spill=30,cache-aware=150"],
    "rag": [*SINGLE_TURN, "--start", "4,prefix=100,prefix-spill=35,cache-aware=100"],
    "chat": [*MULTI_TURN, "--start", "100,prefix=130,prefix-spill=130,cache-aware=130"],
    "long-system-chat": [*MULTI_TURN, "--start", "40,prefix=10,prefix-spill=55,cache-aware=55"],
    "trace-like": [*MULTI_TURN, "--start", "30,prefix=50,prefix-spill=40"],
    "code": [*SINGLE_TURN, "--start", "40,prefix=60,prefix-spill=50"],
    "group-prompts": [*SINGLE_TURN, "--start", "25,prefix=50,prefix-spill=40"],
    "hot-prefix": [*SINGLE_TURN, "--start", "15,prefix=20,prefix-spill=20"],
    "unique": [*SINGLE_TURN, "--start", "22"],
    "mixed": [*MULTI_TURN, "--start", "20,prefix=30,prefix-spill=45,cache-aware=45"],
}
"""Per workload: how each run is sized and where each policy's search starts (a guess near
its knee; a poor start costs a bracketing step or two, not accuracy). Workloads are sized as
in bench/scripts/routing_defaults.py (:data:`SCALE`: pools of prompts 3.5x the older
defaults, so one instance cannot cache them all; :data:`THINK`: shorter think times). A
workload bench/workloads.py does not have is skipped with a note."""

ALL = ",".join(WORKLOADS)

FLEET_POLICIES = "round-robin,prefix,prefix-spill"
"""The fleet search (4-64 instances at round robin's capacity) for these only: it costs as
much as a capacity search per policy."""

LIVE_FLEET = ["--instances", "2", "--num-gpu-blocks", "28750", "--prefill-tokens-per-s", "12000"]
LIVE_WORKLOADS: dict[str, tuple[list[str], float]] = {
    "system-prompt": (["--set", "prompts=42"], 8.0),
    "rag": (["--set", "docs=84"], 8.0),
    "code": (["--set", "files=42"], 10.0),
    "group-prompts": (["--set", "groups=32"], 20.0),
    "hot-prefix": (["--set", "prompts=42"], 4.0),
    "unique": ([], 4.0),
}
"""The workloads checked live, each on two instances (all the 2-core machine runs live at a
knee) with a quarter of the sweep's pool of prompts, documents, files or groups (the same
per instance as in the sweep), and where its 2-instance knee search starts. The multi-turn
workloads are not run live: at their knees a run that reaches steady state is ~10,000
requests, hours at a time scale the host keeps up with."""
LIVE_REQUESTS = 1200
LIVE_MIN_DURATION = 60.0
"""The 2-instance knee search's runs last at least this many model seconds: a knee judged
on keeping up (requests completed in the window) needs the window to start after
completions have caught up with arrivals, as in the sweep's single-turn runs. The live run
at the knee and its DES twin stay at :data:`LIVE_REQUESTS`: they are compared with each
other, not judged."""
LIVE_REAL_RATE = 2.5
"""Requests per wall-clock second the live stack is driven at: the time scale is
``LIVE_REAL_RATE / knee`` (at most 1). The simulated clock stands still between steps, so
the host's own time between steps compresses arrivals in simulated time; at the first live
check (time scale 2, 79 requests per wall second on 2 cores) that made the knee's P50 26x
the DES's. System prompts at 39.55 requests/s: P50 live/DES 26x at time scale 2, 1.47x at
0.5, 1.15x at 0.25, 1.07x at 0.125 (4.9 requests per wall second); hit rate equal at all
but 2. Per-group prompts at 12.08 requests/s: 1.17x at 5 requests per wall second, 1.09x
at 2.5, hence 2.5 (system prompts, hot prefix and unique prompts were checked at 5)."""

LIVE_MULTI_TURN: dict[str, tuple[list[str], float, float]] = {
    "chat": (["--set", "think_mean_s=2.0"], 30.0, 0.2),
    "long-system-chat": (["--set", "think_mean_s=2.0"], 11.0, 0.3),
    "trace-like": (["--set", "think_mean_s=4.0"], 4.5, 0.85),
    "mixed": (["--set", "pool_scale=0.875", "--set", "think_mean_s=4.0"], 5.5, 0.45),
}
"""Multi-turn workloads checked live at one rate each, not at a knee: ``(args, rate, time
scale)``. A run that reaches their steady state is ~10,000 requests (hours at a time scale
the host keeps up with), so the check is 1,200 requests of the fleet filling up, the same
conversations live and in the DES; the time scale keeps the stack near
:data:`LIVE_REAL_RATE` requests per wall second or below (2 instances serve 12, 4 and 3
requests/s of these runs: turns wait for answers and think times). long-system-chat at
time scale 0.6 (2.4 requests per wall second): P50 63.2 ms live, 55.0 in the DES (1.15x),
hit rate 0.944 both, P99 1.01x; hence half that. The mix runs at a quarter of
routing_defaults.py's rate and pools (22 requests/s, pool scale 3.5, on 8 instances)."""


def live_time_scale(knee: float) -> float:
    return round(min(1.0, LIVE_REAL_RATE / knee), 4)


def run(args: list[str]) -> None:
    print("+ prefix-router bench " + shlex.join(args), flush=True)
    code = bench(args)
    if code:
        sys.exit(code)


def sweep(chosen: list[str], jobs: int, policies: str, fleet_policies: str = "") -> None:
    began = time.monotonic()
    for name in chosen:
        if name not in KNOWN:
            print(f"- {name}: not in bench/workloads.py yet, skipped", flush=True)
            continue
        run(
            [
                "capacity",
                "--workload",
                name,
                *scaled(name),
                *FLEET,
                *WORKLOADS[name],
                "--jobs",
                str(jobs),
                "--policies",
                policies,
                "--fleet-policies",
                fleet_policies or FLEET_POLICIES,
                "--out",
                str(OUT),
            ]
        )
    print(f"sweep: {time.monotonic() - began:.0f} s wall", flush=True)


def live_knee(name: str) -> None:
    """prefix-spill's knee for ``name`` on two instances in the DES, unless saved."""
    args, start = LIVE_WORKLOADS[name]
    if (KNEE / f"{name}.json").exists():
        return
    run(
        [
            "capacity",
            "--workload",
            name,
            *args,
            *LIVE_FLEET,
            "--policies",
            "prefix-spill",
            "--run-requests",
            str(LIVE_REQUESTS),
            "--min-duration",
            f"{LIVE_MIN_DURATION:g}",
            "--warmup",
            "0.5",
            "--start",
            f"{start:g}",
            "--fleet-load",
            "0",
            "--out",
            str(KNEE),
        ]
    )


BELOW_KNEE = 0.8
"""``live --below-knee`` runs single-turn workloads at this fraction of the knee as well: at
the knee itself one run's P50 and P99 scatter by themselves (the DES alone, seeds 1-6:
P50 86-153 ms on RAG, P99 74-1,712 ms on code), so agreement is judged below it too."""


def live_folder(fraction: float) -> Path:
    return LIVE if fraction == 1.0 else LIVE / f"at-{fraction:g}-knee"


def live(chosen: list[str], fraction: float = 1.0) -> None:
    """Per workload: prefix-spill's knee on two instances in the DES (searched once, then
    reused from ``live-knee/``), then that rate (times ``fraction``) through the real stack
    and in the DES with the same seed; both judged on the window the search judges a run
    by (``live.md``). Multi-turn workloads run at their fixed rate only."""
    for name in chosen:
        point = live_point(name, fraction)
        if point is None:
            print(f"- {name}: not checked live at {fraction:g} x knee", flush=True)
            continue
        args, knee, scale = point
        if not knee:
            print(f"- {name}: no knee on two instances", flush=True)
            continue
        same = [
            "--workload",
            name,
            *args,
            *LIVE_FLEET,
            "--policies",
            "prefix-spill",
            "--rate",
            f"{knee:g}",
            "--requests",
            str(LIVE_REQUESTS),
            "--seed",
            "1",
            "--out",
            str(live_folder(fraction)),
        ]
        run(["des", *same])
        run(["run", *same, "--time-scale", f"{scale:g}", "--ext-procs", "1"])
    live_report()


def live_point(name: str, fraction: float = 1.0) -> tuple[list[str], float, float] | None:
    """``(args, rate, time scale)`` of ``name``'s live check: ``fraction`` of prefix-spill's
    knee on two instances (searched in the DES unless saved), or a multi-turn workload's
    fixed rate (at ``fraction`` 1 only)."""
    if name in LIVE_MULTI_TURN:
        return LIVE_MULTI_TURN[name] if fraction == 1.0 else None
    if name not in LIVE_WORKLOADS:
        return None
    live_knee(name)
    saved = orjson.loads((KNEE / f"{name}.json").read_bytes())
    knee = float(saved["capacities"][0]["search"]["lo"] or 0.0)
    rate = knee if fraction == 1.0 else round(knee * fraction, 2)
    return LIVE_WORKLOADS[name][0], rate, live_time_scale(rate)


def live_report() -> None:
    """``live.md`` from every saved live and DES run (``live`` ends with it, so checking
    one workload again keeps the others' rows)."""
    rows: list[str] = []
    for fraction in (1.0, BELOW_KNEE):
        for name in [*LIVE_WORKLOADS, *LIVE_MULTI_TURN]:
            if not (live_folder(fraction) / name / "live-prefix-spill.json").exists():
                continue
            point = live_point(name, fraction)
            if point is not None:
                rows += compare_rows(name, point[1], fraction)
    write_live(rows)


def offered_rate(params: str) -> float | None:
    """The rate a saved run was offered, from its params (``rate=...``)."""
    found = re.search(r"(?:^|, )rate=([0-9.]+)", params)
    return float(found.group(1)) if found else None


def compare_rows(name: str, rate: float, fraction: float = 1.0) -> list[str]:
    """Table rows: the live run and the DES run of ``name`` saved under ``fraction`` of its
    knee, over the window the capacity search measures. ``rate`` is ``fraction`` of today's
    knee; a run saved before the knee moved ran at the rate its params say, and its row
    says which share of today's knee that is."""
    from bench.capacity import Objective, measure
    from bench.results import RunResult

    folder = live_folder(fraction) / name
    runs = [RunResult.load(folder / f"{mode}-prefix-spill.json") for mode in ("des", "live")]
    live_run = runs[1]
    knee = rate / fraction
    rate = offered_rate(live_run.params) or rate
    d, v = (
        measure(run, (0.5 * last, last), Objective(), rate=rate, instances=2, seed=1)
        for run in runs
        for last in [max(r.arrival_s for r in run.records)]
    )
    errors = live_run.errors
    scale = live_run.time_scale
    if name in LIVE_MULTI_TURN:  # the rate it approaches once conversations overlap
        head = f"{name} at --rate {rate:g} (filling up), time scale {scale:g}"
    else:
        head = f"{name} at {rate:g} req/s ({rate / knee:.2g} x knee), time scale {scale:g}"
    rows = []
    for what, a, b in (
        ("TTFT P50 ms", d.p50_s * 1000, v.p50_s * 1000),
        ("TTFT P99 ms", d.p99_s * 1000, v.p99_s * 1000),
        ("hit rate", d.hit_rate, v.hit_rate),
        ("goodput req/s", d.goodput_rps, v.goodput_rps),
    ):
        versus = f"{b / a:.2f}" if a else "-"
        rows.append(f"| {head} | {what} | {a:,.3g} | {b:,.3g} | {versus} |")
        head = ""
    rows.append(f"| | objective met | {d.passed} | {v.passed} (errors: {errors}) | |")
    return rows


SPREAD_SEEDS = range(1, 7)


def seed_spread(chosen: list[str]) -> None:
    """Each live knee's run in the DES with seeds 1-6: how much P50 and P99 of one
    1,200-request run scatter there by themselves (what live-vs-DES agreement can be
    held to)."""
    from bench.capacity import ProbeSetup, RunPlan, run_probe
    from bench.policies import Policy
    from prefix_router.core.config import RouterConfig
    from vllm_sim.config import make_config

    engine = make_config(num_gpu_blocks=NUM_GPU_BLOCKS, prefill_tokens_per_s=PREFILL_TOKENS_PER_S)
    for name in chosen:
        if name not in LIVE_WORKLOADS or not (KNEE / f"{name}.json").exists():
            continue
        args, _ = LIVE_WORKLOADS[name]
        pairs = (pair.partition("=") for pair in args[1::2])  # "--set k=v"
        setup = ProbeSetup(
            workload=name,
            overrides=tuple((k, v) for k, _, v in pairs),
            policy=Policy.PREFIX_SPILL,
            engine=engine,
            router=RouterConfig(),
            plan=RunPlan(requests=LIVE_REQUESTS, warmup=0.5),
        )
        knee = orjson.loads((KNEE / f"{name}.json").read_bytes())["capacities"][0]["search"]["lo"]
        probes = [run_probe(setup, knee, 2, seed) for seed in SPREAD_SEEDS]
        cells = ", ".join(f"{p.p50_s * 1000:,.0f}/{p.p99_s * 1000:,.0f}" for p in probes)
        print(f"{name} at {knee:g} req/s, P50/P99 ms by seed: {cells}", flush=True)


def write_live(rows: list[str]) -> None:
    lines = [
        "# Live vs DES at prefix-spill's knee (2 instances)",
        "",
        f"`bench/scripts/capacity.py live`: per single-turn workload, prefix-spill's knee on"
        f" two instances in the DES, then {LIVE_REQUESTS:,} requests at that rate through the"
        " real stack (Envoy, one ext_proc, the control plane, Redis, the simulator) and in the"
        " DES, seed 1; both judged on the second half of the arrivals, as the capacity search"
        " judges a run. Multi-turn workloads run at one fixed rate each (their steady state"
        " takes ~10,000 requests, hours live): the fleet filling up with conversations. The"
        f" time scale keeps the stack near {LIVE_REAL_RATE:g} requests per wall second (rows"
        " at twice that were run before the rate was halved: a busier host compresses"
        " simulated time and adds ~10% to P50). RAG's and code's knee rows ran with the"
        " spill defaults of stop 32 (miss weight 100, no ConcurrencyThreshold), whose knees"
        " are 1.8x and 2.7x the earlier ones: their 1,200 requests last 12-26 model seconds,"
        " so the judged half is still the cold start (code's P50 of 3.4 s). The hot prefix's"
        " knee row ran with stop 33's defaults (load factor 1.4, placement width 8; its"
        " two-instance knee 9.7 -> 10.1). The trace-like and chat rows ran with the same"
        " defaults in stop 34, ext_proc deciding on its copy of the routing state in Redis"
        " (redis_max_staleness_ms 10) instead of waiting for a round trip per request. The"
        " long-system-chat, per-group prompts, system-prompt and unique rows ran with the same"
        " defaults in stop 35, writes riding a round trip within 5 ms (the last three's DES"
        " runs are byte-identical to those with the defaults before; their knees were not"
        " searched again). RAG's and code's rows at 0.8 x their knee ran with the same"
        " defaults in stop 36; at those rates 1,200 requests last 15-32 model seconds, so"
        " their judged half is still the cold start too (code's P50 of 0.9-1.1 s). The"
        " mixed and trace-like rows ran in stop 42 with today's defaults (a request's end"
        " stamps its blocks in the index again), the mix at a quarter of"
        " routing_defaults.py's rate and pools; trace-like's live P50 was the same with the"
        " code before (175 ms live against 168 in the DES, hit rate 0.684 / 0.685, one run"
        " the same hour), so the DES's P50 fell 10% with the change where live's did not"
        " (two runs), while the hit rate rose alike. Every other row ran with the defaults"
        " before (miss weight 3, ConcurrencyThreshold 256), whose decisions are the same"
        " code live and in the DES; 'x knee' is the fraction of today's knee.",
        "",
        "| workload | measure | DES | live | live / DES |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    out = OUT / "live.md"
    out.write_text("\n".join(lines))
    print(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "part", choices=("sweep", "live-knees", "live", "live-report", "seed-spread", "report")
    )
    parser.add_argument("--only", default=ALL, help="comma-separated workloads")
    parser.add_argument("--jobs", type=int, default=2, help="policies searched at once")
    parser.add_argument(
        "--fleet-policies",
        default=FLEET_POLICIES,
        help="sweep: the policies whose smallest fleet is searched too",
    )
    parser.add_argument(
        "--below-knee",
        action="store_true",
        help=f"live: run single-turn workloads at {BELOW_KNEE:g} x their knee instead",
    )
    parser.add_argument(
        "--policies",
        default="all",
        help="e.g. cache-aware: add one policy to saved results (the others are kept)",
    )
    args = parser.parse_args()
    chosen = [w for w in args.only.split(",") if w]
    checked = chosen if args.only != ALL else [*LIVE_WORKLOADS, *LIVE_MULTI_TURN]
    if args.part == "sweep":
        sweep(chosen, args.jobs, args.policies, args.fleet_policies)
    elif args.part == "live-knees":
        for name in checked:
            live_knee(name)
    elif args.part == "live":
        live(checked, BELOW_KNEE if args.below_knee else 1.0)
    elif args.part == "live-report":
        live_report()
    elif args.part == "seed-spread":
        seed_spread(checked)
    else:
        from bench.capacity import write_report

        print(write_report(OUT))


if __name__ == "__main__":
    main()
