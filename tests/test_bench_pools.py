"""The pooled discrete-event simulation: every policy keeps each request inside its
model's pool, and the router's hit rate comes near the per-pool fleet-LRU bound."""

from __future__ import annotations

import pytest

from bench.des import DesSettings
from bench.policies import Policy
from bench.pools import PooledSimulation
from bench.workloads import generate
from prefix_router.core.config import RouterConfig
from vllm_sim.config import make_config

SERVE = [["base-a", "a-sql"], ["base-a"], ["base-b"], ["base-b"]]
MIX = {"base-a": 0.4, "a-sql": 0.2, "base-b": 0.4}


def run(policy: Policy, serve: list[list[str]] = SERVE) -> PooledSimulation:
    workload = generate("system-prompt", {"requests": 120, "rate": 8, "prompts": 12})
    settings = DesSettings(
        policy=policy,
        engine=make_config("llama-3.1-8b-1xh100"),
        router=RouterConfig(),
        instances=len(serve),
    )
    return PooledSimulation(workload, settings, serve=serve, mix=MIX)


@pytest.mark.parametrize("policy", [Policy.ROUND_ROBIN, Policy.LEAST_REQUEST, Policy.PREFIX_SPILL])
def test_every_request_reaches_an_instance_serving_its_model(policy: Policy) -> None:
    sim = run(policy)
    result = sim.run()  # raises if a request reached an instance not serving its model
    assert result.errors == 0 and len(result.ok) == 120
    served = {m for s in SERVE for m in s}
    assert set(sim._model_of.values()) == served  # every pool had traffic
    bounds = result.bounds
    assert bounds is not None and 0 < bounds.fleet_lru <= bounds.infinite


def test_the_router_beats_round_robin_and_nears_the_per_pool_bound() -> None:
    rr, router = run(Policy.ROUND_ROBIN).run(), run(Policy.PREFIX_SPILL).run()
    assert router.bounds is not None
    assert router.hit_rate > rr.hit_rate
    assert router.hit_rate >= 0.9 * router.bounds.fleet_lru


def test_a_model_nobody_serves_or_a_policy_without_pools_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="nobody serves"):
        run(Policy.ROUND_ROBIN, serve=[["base-a"], ["base-b"]])
    with pytest.raises(ValueError, match="no pools"):
        run(Policy.CACHE_AWARE)
