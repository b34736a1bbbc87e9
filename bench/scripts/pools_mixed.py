"""A fleet serving two base models, one of them with LoRA adapters of skewed popularity,
in the discrete-event simulation (:mod:`bench.pools`): hit rate against the per-pool
fleet-LRU bound, TTFT against round robin within each pool.

    python bench/scripts/pools_mixed.py [--workload system-prompt] [--requests 3000]
        [--rate 16] [--instances 8] [--policies round-robin,least-request,prefix-spill]

Issue 22's goal: with the router, hit rate >= 95% of the per-pool fleet-LRU bound, and P99
TTFT no worse than per-pool round robin. Every group of the workload (a system prompt, a
document, a conversation) is given one model, drawn from ``MIX``.
"""

from __future__ import annotations

import argparse

from bench.des import DesSettings
from bench.policies import parse_policies
from bench.pools import PooledSimulation
from bench.workloads import generate
from prefix_router.core.config import RouterConfig
from vllm_sim.config import make_config

ADAPTERS = [f"a-lora-{n}" for n in range(4)]
MIX = {
    "base-a": 0.35,
    "base-b": 0.35,
    # adapters of base-a, Zipf popularity (1, 1/2, 1/3, 1/4) sharing the rest
    **{
        name: 0.30 * (1 / (n + 1)) / sum(1 / (k + 1) for k in range(4))
        for n, name in enumerate(ADAPTERS)
    },
}
SERVE = [
    ["base-a", "a-lora-0", "a-lora-1"],
    ["base-a", "a-lora-0", "a-lora-2"],
    ["base-a", "a-lora-0", "a-lora-1", "a-lora-3"],
    ["base-a", "a-lora-2", "a-lora-3"],
    ["base-b"],
    ["base-b"],
    ["base-b"],
    ["base-b"],
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="system-prompt")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--instances", type=int, default=len(SERVE))
    p.add_argument("--policies", default="round-robin,least-request,prefix-spill")
    p.add_argument("--num-gpu-blocks", type=int, default=0, help="KV blocks per instance")
    args = p.parse_args()
    workload = generate(args.workload, {"requests": args.requests, "rate": args.rate})
    overrides = {"num_gpu_blocks": args.num_gpu_blocks} if args.num_gpu_blocks else {}
    engine = make_config("llama-3.1-70b-8xh100", **overrides)
    print(
        f"{workload.name}, {args.requests} requests at {args.rate}/s, {args.instances} "
        f"instances; mix {', '.join(f'{m} {w:.2f}' for m, w in MIX.items())}"
    )
    print(
        f"{'policy':15s} {'hit rate':>9s} {'pool LRU bound':>15s} {'of bound':>9s} "
        f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'errors':>7s}"
    )
    for policy in parse_policies(args.policies):
        settings = DesSettings(
            policy=policy, engine=engine, router=RouterConfig(), instances=args.instances
        )
        result = PooledSimulation(workload, settings, serve=SERVE, mix=MIX).run()
        bound = result.bounds.fleet_lru if result.bounds else 0.0
        share = result.hit_rate / bound if bound else 0.0
        print(
            f"{policy.value:15s} {result.hit_rate:9.1%} {bound:15.1%} {share:9.1%} "
            f"{1000 * result.ttft(50):7.0f}ms {1000 * result.ttft(99):7.0f}ms "
            f"{result.errors:7d}"
        )


if __name__ == "__main__":
    main()
