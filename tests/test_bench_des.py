"""The discrete-event simulation: the simulator's engine and the router's decisions, exactly."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from bench.des import (
    DesSettings,
    Resize,
    default_instance_url,
    parse_resizes,
    simulate,
)
from bench.policies import Policy
from bench.spec import PATHS, Arrival, Turn, Workload, request_body
from bench.text import filler
from bench.workloads import generate
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.key import extract_key
from prefix_router.core.table import RoutingTable
from vllm_sim.config import make_config
from vllm_sim.engine import Engine
from vllm_sim.protocol import parse_generation

ENGINE = make_config(num_gpu_blocks=512)
SMALL_STEPS = {"num_gpu_blocks": 512, "max_num_batched_tokens": 256}
"""A small token budget: prompts are prefilled in chunks over several steps."""


def workload_of(arrivals: list[Arrival]) -> Workload:
    return Workload("tiny", sum(len(a.turns) for a in arrivals), lambda: iter(arrivals))


def tiny_arrivals() -> list[Arrival]:
    shared = filler("shared", 300)
    out = []
    for i in range(6):
        user = filler(f"user{i}", 20 + 37 * i)
        messages = (("system", shared), ("user", user)) if i % 2 else (("user", user),)
        out.append(Arrival(0.0, f"g{i}", (Turn(max_tokens=3 + i, messages=messages),)))
    return out


async def engine_ttfts(arrivals: list[Arrival]) -> list[float]:
    """The simulator's asyncio engine, all requests arriving at simulated time 0."""
    config = make_config(time_scale=1e6, **SMALL_STEPS)
    engine = Engine(config, wall_clock=lambda: 0.0)  # frozen wall: mid-step arrivals at 0
    engine.start()
    params = [parse_generation(request_body(a.turns[0], model=config.model), "chat", config)
              for a in arrivals]
    handles = [engine.submit(params[0].params)]
    while not engine.scheduler.running:
        await asyncio.sleep(0)
    handles += [engine.submit(p.params) for p in params[1:]]
    for handle in handles:
        await handle.wait_done()
    await engine.stop()
    return [h.seq.first_token_time - h.seq.arrival_time for h in handles]  # type: ignore[operator]


async def test_one_instance_agrees_with_the_simulators_engine_exactly() -> None:
    arrivals = tiny_arrivals()
    expected = await engine_ttfts(arrivals)
    result = simulate(workload_of(arrivals), DesSettings(
        policy=Policy.ROUND_ROBIN, engine=make_config(**SMALL_STEPS),
        router=RouterConfig(), instances=1))
    assert [r.ttft_s for r in result.records] == pytest.approx(expected, rel=1e-9)
    assert len(set(expected)) >= 4  # chunked prefill and batching at work
    hits = sum(r.cached_tokens or 0 for r in result.records)
    assert hits >= 2 * 16 * (300 // 4 // 16)  # later system-prompt requests hit the first


RING_ONLY = RouterConfig.model_validate({"placement": {"policy": "home"}})
"""New prefixes start on the ring's pick: pure consistent hashing."""


def candidates_of(workload: Workload, ids: tuple[str, ...]) -> list[list[str]]:
    """Each arrival's ring candidates (the ring's pick first), as ext_proc's table lists them."""
    table = RoutingTable.build(Fleet.of([Instance.from_url(i) for i in ids]), RouterConfig())
    out = []
    for arrival in workload:
        turn = arrival.turns[0]
        key = extract_key(request_body(turn, model=ENGINE.model), settings=table.key_settings,
                          path=PATHS[turn.endpoint])
        out.append([table.ids[c] for c in table.lookup(key.value)[0]])
    return out


def test_prefix_routing_is_envoys_ring_pick() -> None:
    workload = generate("system-prompt", {"requests": 120, "rate": 50.0, "prompts": 10,
                                          "prompt_tokens": 64, "output_min": 2,
                                          "output_max": 4})
    ids = tuple(f"127.0.0.1:{9000 + i}" for i in range(4))
    result = simulate(workload, DesSettings(policy=Policy.PREFIX, engine=ENGINE,
                                            router=RING_ONLY, instance_ids=ids))
    candidates = candidates_of(workload, ids)
    for ring, record in zip(candidates, result.records, strict=True):
        assert record.instance == ring[0]
    assert result.hit_rate <= result.bounds.infinite + 1e-9  # type: ignore[union-attr]


def test_a_new_prefix_starts_on_a_less_loaded_candidate_and_stays_there() -> None:
    # system prompts longer than PrefixLength (1024 bytes): one key per prompt
    workload = generate("system-prompt", {"requests": 400, "rate": 200.0, "prompts": 40,
                                          "prompt_tokens": 300, "output_min": 20,
                                          "output_max": 40})
    ids = tuple(f"127.0.0.1:{9000 + i}" for i in range(4))
    result = simulate(workload, DesSettings(policy=Policy.PREFIX, engine=ENGINE,
                                            router=RouterConfig(), instance_ids=ids))
    rings = {a.group: ring for a, ring in zip(workload, candidates_of(workload, ids),
                                              strict=True)}
    homes: dict[str, set[str | None]] = defaultdict(set)
    for arrival, record in zip(workload, result.records, strict=True):
        homes[arrival.group].add(record.instance)
    assert all(len(h) == 1 for h in homes.values())  # every prefix keeps one home
    off_ring = [g for g, h in homes.items() if h != {rings[g][0]}]
    assert off_ring  # placed by load, not by the ring alone
    width = RouterConfig().placement.width
    assert all(homes[g] <= set(rings[g][:width]) for g in homes)
    ring = simulate(workload, DesSettings(policy=Policy.PREFIX, engine=ENGINE,
                                          router=RING_ONLY, instance_ids=ids))
    spread = [i.requests for i in result.instances]
    ring_spread = [i.requests for i in ring.instances]
    assert max(spread) - min(spread) < max(ring_spread) - min(ring_spread)


def test_round_robin_and_least_request_spread_evenly() -> None:
    workload = generate("unique", {"requests": 90, "rate": 100.0, "prompt_min": 20,
                                   "prompt_max": 40, "output_min": 2, "output_max": 2})
    rr = simulate(workload, DesSettings(policy=Policy.ROUND_ROBIN, engine=ENGINE,
                                        router=RouterConfig(), instances=3))
    assert sorted(i.requests for i in rr.instances) == [30, 30, 30]
    lr = simulate(workload, DesSettings(policy=Policy.LEAST_REQUEST, engine=ENGINE,
                                        router=RouterConfig(), instances=3))
    assert all(i.requests > 15 for i in lr.instances)


def test_spill_walks_the_ring_when_home_is_at_the_threshold() -> None:
    prompt = filler("hot", 400)
    arrivals = [Arrival(0.001 * i, "hot", (Turn(max_tokens=50, messages=(("user", prompt),)),))
                for i in range(4)]
    router = RouterConfig(concurrency_threshold=1)
    ids = tuple(f"127.0.0.1:{9100 + i}" for i in range(4))
    nospill = simulate(workload_of(arrivals), DesSettings(
        policy=Policy.PREFIX, engine=ENGINE, router=router, instance_ids=ids))
    spill = simulate(workload_of(arrivals), DesSettings(
        policy=Policy.PREFIX_SPILL, engine=ENGINE, router=router, instance_ids=ids))
    assert len({r.instance for r in nospill.records}) == 1
    table = RoutingTable.build(Fleet.of([Instance.from_url(i) for i in ids]), router)
    key = extract_key(request_body(arrivals[0].turns[0], model=ENGINE.model),
                      settings=table.key_settings).value
    ring_order = [table.ids[c] for c in table.lookup(key)[0]]
    assert [r.instance for r in spill.records] == ring_order  # home, 2nd, 3rd, 4th home
    assert spill.peak_in_flight == 1 < nospill.peak_in_flight


@pytest.mark.parametrize("placement", ["home", "least-loaded"])
def test_a_resize_moves_just_the_keys_the_ring_gives_the_new_instance(placement: str) -> None:
    # system prompts longer than PrefixLength (1024 bytes): one key per prompt
    workload = generate("system-prompt", {"requests": 1200, "rate": 40.0, "prompts": 120,
                                          "prompt_tokens": 300, "output_min": 1,
                                          "output_max": 2})
    router = RouterConfig.model_validate({"placement": {"policy": placement}})
    result = simulate(workload, DesSettings(policy=Policy.PREFIX, engine=ENGINE,
                                            router=router, instances=4,
                                            resizes=(Resize(15.0, +1),)))
    before: dict[str, set[str | None]] = defaultdict(set)
    after: dict[str, set[str | None]] = defaultdict(set)
    for arrival, record in zip(workload, result.records, strict=True):
        (before if record.arrival_s < 15.0 else after)[arrival.group].add(record.instance)
    new = next(i.id for i in result.instances if i.id not in
               {r.instance for r in result.records if r.arrival_s < 15.0})
    urls = tuple(default_instance_url(i) for i in range(5))  # the 4, then the new one
    assert Instance.from_url(urls[4]).id == new
    pick_before = {a.group: r[0] for a, r in zip(workload, candidates_of(workload, urls[:4]),
                                                  strict=True)}
    pick_after = {a.group: r[0] for a, r in zip(workload, candidates_of(workload, urls),
                                                 strict=True)}
    given_to_new = {g for g in before if pick_after[g] == new != pick_before[g]}
    moved = {g for g in before if g in after and after[g] != before[g]}
    assert all(len(s) == 1 for s in (*before.values(), *after.values()))
    assert moved == given_to_new and all(after[g] == {new} for g in moved)
    assert 0.05 < len(moved) / len(before) < 0.4  # about 1/5 of the keys
    assert result.events and result.events[0][1] == "+1 -> 5 instances"


def test_resize_parsing() -> None:
    assert parse_resizes("600:-8, 300:+16") == (Resize(300.0, 16), Resize(600.0, -8))
    with pytest.raises(ValueError, match="TIME"):
        parse_resizes("soon:+1")


def test_policies_map_to_the_spill_rules_and_all_means_the_four_compared_by_default() -> None:
    from bench.policies import ALL_POLICIES, parse_policies
    from prefix_router.core.config import PlacementPolicyName, SpillPolicyName

    assert parse_policies("all") == ALL_POLICIES and Policy.PREFIX_RELATIVE not in ALL_POLICIES
    assert parse_policies("prefix-relative") == (Policy.PREFIX_RELATIVE,)
    assert parse_policies("all,prefix-relative") == (*ALL_POLICIES, Policy.PREFIX_RELATIVE)
    base = RouterConfig()
    rules = {
        p: (p.router_config(base).spill.policy, p.router_config(base).placement.policy)
        for p in Policy
        if p.uses_router
    }
    assert rules == {
        Policy.PREFIX: (SpillPolicyName.NONE, PlacementPolicyName.LEAST_LOADED),
        Policy.PREFIX_SPILL: (SpillPolicyName.BOUNDED_LOAD, PlacementPolicyName.LEAST_LOADED),
        Policy.PREFIX_RELATIVE: (SpillPolicyName.RELATIVE_LOAD, PlacementPolicyName.LEAST_LOADED),
        Policy.PREFIX_SPILL_RING: (SpillPolicyName.BOUNDED_LOAD, PlacementPolicyName.HOME),
    }
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policies("prefix,fastest")
