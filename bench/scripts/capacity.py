"""Reproduce bench/results/capacity: capacity at a TTFT objective, per policy and workload.

    python bench/scripts/capacity.py sweep    # every workload x policy in the DES (~25 min)
    python bench/scripts/capacity.py live     # one knee through the real stack vs the DES
    python bench/scripts/capacity.py report   # rebuild report.md and the PNGs

``sweep --only rag,unique`` runs a subset (the others' results are kept); ``--jobs 2`` (the
default) searches two policies at a time. Run it under the heavy-run lock on a shared
machine: ``flock /tmp/prefix-router-heavy.lock python bench/scripts/capacity.py sweep``.
Every step is a ``prefix-router bench`` command, printed before it runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (results are written under ``bench/results``)."""

from bench.cli import main as bench  # noqa: E402
from bench.workloads import WORKLOADS as KNOWN  # noqa: E402

OUT = ROOT / "bench" / "results" / "capacity"
LIVE = OUT / "live"

FLEET = ["--instances", "8", "--num-gpu-blocks", "28750", "--prefill-tokens-per-s", "12000"]
"""Eight Llama-3.1-70B / 8xH100 instances with 460k tokens of KV cache each (28,750 blocks
of 16) and a prefill rate of 12,000 tokens/s: the fleet every capacity figure is for."""

SINGLE_TURN = ["--run-requests", "2000", "--warmup", "0.25"]
"""2,000 requests a run, the first quarter of the run's span not measured: the P99 over
~1,500 requests at the knee, once caches have warmed."""
MULTI_TURN = ["--run-requests", "2000", "--min-duration", "100", "--warmup", "0.5",
              "--seeds", "2"]
"""Conversations live ~70 s (4.5 thinking gaps of 10 s mean, plus answers): runs of at least
100 s of new arrivals, the first 50 s not measured. At chat's knee (~200 requests/s) that is
20,000 requests a run, 10,000 measured (a P99 over 100 tail requests, where single-turn runs
have 15), so two seeds; each run costs ~30 CPU s."""

WORKLOADS: dict[str, list[str]] = {
    "system-prompt": [*SINGLE_TURN, "--start", "27,prefix=130,prefix-spill=32"],
    "rag": [*SINGLE_TURN, "--start", "25,prefix=90,prefix-spill=35"],
    "chat": [*MULTI_TURN, "--start", "190,prefix=250,prefix-spill=250"],
    "long-system-chat": [*MULTI_TURN, "--start", "60,prefix=100,prefix-spill=80"],
    "trace-like": [*MULTI_TURN, "--start", "30,prefix=50,prefix-spill=40"],
    "code": [*SINGLE_TURN, "--start", "35,prefix=60,prefix-spill=50"],
    "group-prompts": [*SINGLE_TURN, "--start", "20,prefix=50,prefix-spill=30"],
    "hot-prefix": [*SINGLE_TURN, "--start", "20,prefix=25,prefix-spill=25"],
    "unique": [*SINGLE_TURN, "--start", "22"],
}
"""Per workload: how each run is sized and where each policy's search starts (near its knee
from an earlier sweep; a poor start costs a bracketing step or two, not accuracy).
A workload bench/workloads.py does not have is skipped with a note."""

LIVE_WORKLOAD = "system-prompt"
LIVE_FLEET = ["--instances", "2", "--num-gpu-blocks", "28750", "--prefill-tokens-per-s", "12000"]
LIVE_WORKLOAD_ARGS = ["--set", "prompts=12"]
"""Two instances (all the 2-core machine runs live at a knee), with the system prompts cut to
12 so each of them holds as many prompts as each of the eight does in the sweep."""
LIVE_REQUESTS = 800
LIVE_TIME_SCALE = "2"


def run(args: list[str]) -> None:
    print("+ prefix-router bench " + shlex.join(args), flush=True)
    code = bench(args)
    if code:
        sys.exit(code)


def sweep(chosen: list[str], jobs: int, policies: str) -> None:
    began = time.monotonic()
    for name in chosen:
        if name not in KNOWN:
            print(f"- {name}: not in bench/workloads.py yet, skipped", flush=True)
            continue
        run(["capacity", "--workload", name, *FLEET, *WORKLOADS[name], "--jobs", str(jobs),
             "--policies", policies, "--out", str(OUT)])
    print(f"sweep: {time.monotonic() - began:.0f} s wall", flush=True)


def live() -> None:
    """prefix-spill's knee on two instances in the DES, then that rate through the real
    stack and again in the DES with the same seed: report.md's DES-vs-live table."""
    knee_dir = LIVE / "knee"
    run(["capacity", "--workload", LIVE_WORKLOAD, *LIVE_WORKLOAD_ARGS, *LIVE_FLEET,
         "--policies", "prefix-spill", "--run-requests", str(LIVE_REQUESTS), "--start", "8",
         "--fleet-load", "0", "--out", str(knee_dir)])
    saved = orjson.loads((knee_dir / f"{LIVE_WORKLOAD}.json").read_bytes())
    knee = saved["capacities"][0]["search"]["lo"]
    same = ["--workload", LIVE_WORKLOAD, *LIVE_WORKLOAD_ARGS, *LIVE_FLEET,
            "--policies", "prefix-spill", "--rate", f"{knee:g}",
            "--requests", str(LIVE_REQUESTS), "--seed", "1", "--out", str(LIVE)]
    run(["des", *same])
    run(["run", *same, "--time-scale", LIVE_TIME_SCALE, "--ext-procs", "1"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("sweep", "live", "report"))
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    parser.add_argument("--jobs", type=int, default=2, help="policies searched at once")
    parser.add_argument("--policies", default="all", help="e.g. cache-aware: add one policy "
                        "to saved results (the others are kept)")
    args = parser.parse_args()
    if args.part == "sweep":
        sweep([w for w in args.only.split(",") if w], args.jobs, args.policies)
    elif args.part == "live":
        live()
    else:
        from bench.capacity import write_report

        print(write_report(OUT))


if __name__ == "__main__":
    main()
