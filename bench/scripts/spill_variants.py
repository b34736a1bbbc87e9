"""prefix-spill with its spill rules changed, one simulated run per (variant, workload, rate).

The capacity sweep (bench/results/capacity) found pure affinity (``prefix``: spill off)
serving 2.1x the then defaults' capacity on RAG and 2.3x on code. This asks which of
prefix-spill's three ways of leaving a prefix's holder cost that, and whether turning it
off costs the workloads that need spill (a hot prefix, the trace-like workload):

* ``spill.miss_weight`` (the score: a holder loses when its queue outweighs what its cache
  saves, the miss counted that many times; 3 then, 100 now);
* ``concurrency_threshold`` (an instance with that many requests waiting for their first
  token takes none while another can; 256 then, off now);
* ``spill.load_factor`` (the in-flight bound: load_factor x the fleet's mean + the slack, 2).

    python bench/scripts/spill_variants.py [--only rag,code] [--variants default,old]

8 instances as in the capacity sweep (28,750 KV blocks, 12,000 prefill tokens/s), seed 1,
5,000 requests and at least 60 model seconds a run, the first half not measured, judged by
the capacity objective (P50 <= 0.5 s, P99 <= 2 s, completed >= 90% of offered). The
multi-turn workloads run 60 s here, not the sweep's 300 s, so "completed" fails them at
every variant: compare their TTFTs only. Prints one line a run.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.capacity import ProbeSetup, RunPlan, run_probe
from bench.policies import Policy
from bench.scripts.routing_defaults import NUM_GPU_BLOCKS, PREFILL_TOKENS_PER_S, SCALE, THINK
from prefix_router.core.config import RouterConfig
from vllm_sim.config import make_config

STOP_32: dict[str, Any] = {"spill": {"load_factor": 1.25}, "placement": {"width": 4}}
"""What stop 32's runs held fixed, the defaults then: the variants below were run with it."""

VARIANTS: dict[str, tuple[Policy, dict[str, Any]]] = {
    "default": (Policy.PREFIX_SPILL, {}),
    "stop32": (Policy.PREFIX_SPILL, STOP_32),
    "prefix": (Policy.PREFIX, STOP_32),
    "old": (
        Policy.PREFIX_SPILL,
        {
            **STOP_32,
            "concurrency_threshold": 256,
            "spill": {"load_factor": 1.25, "miss_weight": 3.0},
        },
    ),
    "mw3": (Policy.PREFIX_SPILL, {**STOP_32, "spill": {"load_factor": 1.25, "miss_weight": 3.0}}),
    "mw30": (Policy.PREFIX_SPILL, {**STOP_32, "spill": {"load_factor": 1.25, "miss_weight": 30.0}}),
    "t256": (Policy.PREFIX_SPILL, {**STOP_32, "concurrency_threshold": 256}),
    "lf1.4": (Policy.PREFIX_SPILL, {**STOP_32, "spill": {"load_factor": 1.4}}),
    "lf2": (Policy.PREFIX_SPILL, {**STOP_32, "spill": {"load_factor": 2.0}}),
    "lf100": (Policy.PREFIX_SPILL, {**STOP_32, "spill": {"load_factor": 100.0}}),
}
"""``default``: today's defaults; ``stop32``: the defaults of stop 32 (miss_weight 100, no
ConcurrencyThreshold, load_factor 1.25, placement width 4), against which every other
variant changes one thing; ``old``: the defaults before those (miss_weight 3,
ConcurrencyThreshold 256); ``mw3`` and ``t256`` put back one of the two."""

RATES: dict[str, tuple[float, ...]] = {
    "rag": (88.0, 120.0, 150.0, 188.0),
    "code": (143.0, 180.0, 336.0),
    "hot-prefix": (39.2, 50.0),
    "trace-like": (20.4, 25.0),
    "system-prompt": (148.0,),
    "group-prompts": (60.9, 75.0),
    "long-system-chat": (50.6,),
    "chat": (148.0,),
    "unique": (21.1,),
}
"""Per workload: prefix-spill's knee in the sweep, and rates up to pure affinity's."""


def one(job: tuple[str, str, float]) -> str:
    variant, workload, rate = job
    policy, patch = VARIANTS[variant]
    overrides = {**SCALE.get(workload, {}), **THINK.get(workload, {})}
    setup = ProbeSetup(
        workload=workload,
        overrides=tuple(overrides.items()),
        policy=policy,
        engine=make_config(
            num_gpu_blocks=NUM_GPU_BLOCKS, prefill_tokens_per_s=PREFILL_TOKENS_PER_S
        ),
        router=RouterConfig().patched(patch) if patch else RouterConfig(),
        plan=RunPlan(requests=5000, min_duration_s=60, warmup=0.5),
    )
    p = run_probe(setup, rate, 8, 1)
    return (
        f"{workload:16s} {variant:10s} {rate:6g} req/s: P50 {p.p50_s * 1000:7,.0f} ms"
        f"  P99 {p.p99_s * 1000:8,.0f} ms  hit {p.hit_rate:.3f}"
        f"  completed/offered {p.served_fraction or 0:.2f}  {'pass' if p.passed else 'FAIL'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(RATES), help="comma-separated workloads")
    parser.add_argument("--variants", default="default,old,mw3,t256")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    jobs = [
        (v, w, r) for w in args.only.split(",") for r in RATES[w] for v in args.variants.split(",")
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        for line in pool.map(one, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
