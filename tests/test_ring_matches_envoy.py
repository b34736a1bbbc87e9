"""The ring mirror against live Envoy: every key goes where the mirror says."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from prefix_router.core.ring import Ring, ring_size_for
from prefix_router.core.table import RoutingTable
from tests.conftest import ProcessReaper
from tests.support.static_stack import start_static_stack

pytestmark = pytest.mark.e2e

CONFIGS = {
    "three-equal": ([1, 1, 1], None, None),
    "five-weighted": ([1, 2, 3, 1, 5], None, None),
    "four-hash-keys": ([2, 1, 1, 3], ["gpu-a", "gpu-b", None, "gpu-d"], None),
    # named by DNS: Envoy gets 127.0.0.1, and hashes "localhost:port" as the mirror does
    "three-named": ([1, 2, 1], None, ["localhost", "127.0.0.1", "localhost"]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mirror_agrees_with_envoy_on_500_random_keys(
    name: str, procs: ProcessReaper, log_dir: Path
) -> None:
    weights, hash_keys, addresses = CONFIGS[name]
    stack = start_static_stack(
        procs,
        log_dir,
        backends=len(weights),
        weights=weights,
        hash_keys=hash_keys,
        addresses=addresses,
    )
    routable = stack.fleet.routable
    ring = Ring.build(
        routable, minimum_ring_size=ring_size_for(routable, stack.config.ring.entries_per_weight)
    )
    rng = random.Random(name)
    agree = 0
    used: set[str] = set()
    with httpx.Client(timeout=10) as client:
        for _ in range(500):
            prompt = "".join(rng.choice("abcdefghij ") for _ in range(40))
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]})
            answer = client.post(f"{stack.url}/v1/chat/completions", content=body).json()
            predicted = ring.pick(answer["prefix_key"])
            assert predicted is not None
            agree += str(predicted.port) == answer["backend"]
            used.add(answer["backend"])
    assert agree == 500
    assert len(used) == len(weights)


POOLED = {
    # two base models on disjoint instances, an adapter on a subset of one of them
    "two-models-and-an-adapter": (
        [1, 2, 1, 1, 3],
        [["base-a"], ["base-a", "base-a-sql"], ["base-a", "base-a-sql"], ["base-b"], ["base-b"]],
    ),
    # one instance declares nothing: it is in every pool and alone in the catch-all
    "with-a-catch-all": ([1, 1, 2, 1], [["base-a"], ["base-b"], [], ["base-a", "base-b"]]),
}


@pytest.mark.parametrize("name", list(POOLED))
def test_each_pools_mirror_agrees_with_envoys_cluster_for_that_pool(
    name: str, procs: ProcessReaper, log_dir: Path
) -> None:
    """A cluster per pool, each with its own ring: Envoy picks, for every request, the
    instance ext_proc's mirror of that pool picks, and never one outside the pool."""
    weights, models = POOLED[name]
    stack = start_static_stack(
        procs, log_dir, backends=len(weights), weights=weights, models=models
    )
    table = RoutingTable.build(stack.fleet, stack.config)
    asked = [*table.pools, *(["not-declared-anywhere"] if table.catch_all else [])]
    assert set(table.pools) == {m for served in models for m in served}
    rng = random.Random(name)
    with httpx.Client(timeout=10) as client:
        for model in asked:
            pool = table.pool_for(model)
            assert pool is not None
            members = {table.ids[i].rsplit(":", 1)[1] for i in pool.members}
            used: set[str] = set()
            for _ in range(150):
                prompt = "".join(rng.choice("abcdefghij ") for _ in range(40))
                body = json.dumps(
                    {"model": model, "messages": [{"role": "user", "content": prompt}]}
                )
                answer = client.post(f"{stack.url}/v1/chat/completions", content=body).json()
                predicted = pool.ring.pick(answer["prefix_key"])
                assert predicted is not None
                assert str(predicted.port) == answer["backend"], (model, answer)
                used.add(answer["backend"])
            assert used == members, model
