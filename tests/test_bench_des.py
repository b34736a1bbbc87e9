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
from bench.results import RunResult
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
ROOMY = make_config(num_gpu_blocks=8192)
"""A KV cache that holds every prompt of a test workload: the index forgets nothing."""
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
    params = [
        parse_generation(request_body(a.turns[0], model=config.model), "chat", config)
        for a in arrivals
    ]
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
    result = simulate(
        workload_of(arrivals),
        DesSettings(
            policy=Policy.ROUND_ROBIN,
            engine=make_config(**SMALL_STEPS),
            router=RouterConfig(),
            instances=1,
        ),
    )
    assert [r.ttft_s for r in result.records] == pytest.approx(expected, rel=1e-9)
    assert len(set(expected)) >= 4  # chunked prefill and batching at work
    hits = sum(r.cached_tokens or 0 for r in result.records)
    assert hits >= 2 * 16 * (300 // 4 // 16)  # later system-prompt requests hit the first


def test_every_requests_ttft_floor_is_under_its_ttft_and_is_its_uncachable_prefill() -> None:
    """The floor bounds what any router gives a request: the prefill, alone in one step, of
    the tokens no earlier request left behind; a request nothing before it shares is
    floored at its whole prompt's prefill."""
    arrivals = tiny_arrivals()
    engine = make_config(**SMALL_STEPS)
    for policy in (Policy.ROUND_ROBIN, Policy.PREFIX_SPILL):
        result = simulate(
            workload_of(arrivals),
            DesSettings(policy=policy, engine=engine, router=RouterConfig(), instances=2),
        )
        for r in result.records:
            assert r.ttft_floor_s is not None and r.ttft_s is not None
            assert 0 < r.ttft_floor_s <= r.ttft_s
        first = result.records[0]
        assert first.ttft_floor_s == pytest.approx(
            engine.cost.step_seconds(
                prefill_tokens=first.prompt_tokens, decode_seqs=0, context_tokens=0
            )
        )
        # a later request with the shared system prompt is floored below its whole prefill
        later = result.records[3]
        assert later.ttft_floor_s < engine.cost.step_seconds(
            prefill_tokens=later.prompt_tokens, decode_seqs=0, context_tokens=0
        )


RING_PICK = RouterConfig.model_validate({"placement": {"width": 1}})
"""A prefix nobody holds starts on its key's ring pick: consistent hashing for new prefixes."""


def ring_orders(workload: Workload, ids: tuple[str, ...]) -> list[list[str]]:
    """Each arrival's ring order (the ring's pick first), as ext_proc's table lists it."""
    table = RoutingTable.build(Fleet.of([Instance.from_url(i) for i in ids]), RouterConfig())
    out = []
    for arrival in workload:
        turn = arrival.turns[0]
        key = extract_key(
            request_body(turn, model=ENGINE.model),
            settings=table.key_settings,
            path=PATHS[turn.endpoint],
        )
        out.append([table.ids[c] for c in table.ring_order(key.value)])
    return out


def homes_of(workload: Workload, result: RunResult) -> dict[str, set[str | None]]:
    homes: dict[str, set[str | None]] = defaultdict(set)
    for arrival, record in zip(workload, result.records, strict=True):
        homes[arrival.group].add(record.instance)
    return homes


def test_a_prefix_starts_on_its_ring_pick_and_its_later_requests_follow_it() -> None:
    workload = generate(
        "system-prompt",
        {
            "requests": 120,
            "rate": 50.0,
            "prompts": 10,
            "prompt_tokens": 300,
            "output_min": 2,
            "output_max": 4,
        },
    )
    ids = tuple(f"127.0.0.1:{9000 + i}" for i in range(4))
    result = simulate(
        workload,
        DesSettings(policy=Policy.PREFIX, engine=ROOMY, router=RING_PICK, instance_ids=ids),
    )
    picks = ring_orders(workload, ids)
    first: dict[str, str] = {}
    for arrival, ring, record in zip(workload, picks, result.records, strict=True):
        first.setdefault(arrival.group, ring[0])
        assert record.instance == first[arrival.group]
    assert len(set(first.values())) > 1
    assert result.hit_rate <= result.bounds.infinite + 1e-9  # type: ignore[union-attr]


def test_a_new_prefix_starts_on_a_less_loaded_candidate_and_stays_there() -> None:
    workload = generate(
        "system-prompt",
        {
            "requests": 400,
            "rate": 200.0,
            "prompts": 40,
            "prompt_tokens": 300,
            "output_min": 20,
            "output_max": 40,
        },
    )
    ids = tuple(f"127.0.0.1:{9000 + i}" for i in range(4))
    result = simulate(
        workload,
        DesSettings(policy=Policy.PREFIX, engine=ROOMY, router=RouterConfig(), instance_ids=ids),
    )
    first_ring: dict[str, list[str]] = {}
    for arrival, ring in zip(workload, ring_orders(workload, ids), strict=True):
        first_ring.setdefault(arrival.group, ring)
    homes = homes_of(workload, result)
    assert all(len(h) == 1 for h in homes.values())  # every prefix keeps one home
    off_pick = [g for g, h in homes.items() if h != {first_ring[g][0]}]
    assert off_pick  # placed by load, not by the ring alone
    assert all(homes[g] <= set(first_ring[g]) for g in homes)  # among its ring candidates
    ring = simulate(
        workload,
        DesSettings(policy=Policy.PREFIX, engine=ROOMY, router=RING_PICK, instance_ids=ids),
    )
    spread = [i.requests for i in result.instances]
    ring_spread = [i.requests for i in ring.instances]
    assert max(spread) - min(spread) < max(ring_spread) - min(ring_spread)


def test_round_robin_and_least_request_spread_evenly() -> None:
    workload = generate(
        "unique",
        {
            "requests": 90,
            "rate": 100.0,
            "prompt_min": 20,
            "prompt_max": 40,
            "output_min": 2,
            "output_max": 2,
        },
    )
    rr = simulate(
        workload,
        DesSettings(policy=Policy.ROUND_ROBIN, engine=ENGINE, router=RouterConfig(), instances=3),
    )
    assert sorted(i.requests for i in rr.instances) == [30, 30, 30]
    lr = simulate(
        workload,
        DesSettings(policy=Policy.LEAST_REQUEST, engine=ENGINE, router=RouterConfig(), instances=3),
    )
    assert all(i.requests > 15 for i in lr.instances)


def test_a_hot_prefix_waits_for_its_holder_then_spreads_over_the_in_flight_bound() -> None:
    prompt = filler("hot", 2000)
    arrivals = [
        Arrival(0.001 * i, "hot", (Turn(max_tokens=50, messages=(("user", prompt),)),))
        for i in range(12)
    ]
    ids = tuple(f"127.0.0.1:{9100 + i}" for i in range(4))
    nospill = simulate(
        workload_of(arrivals),
        DesSettings(policy=Policy.PREFIX, engine=ENGINE, router=RouterConfig(), instance_ids=ids),
    )
    spill = simulate(
        workload_of(arrivals),
        DesSettings(
            policy=Policy.PREFIX_SPILL, engine=ENGINE, router=RouterConfig(), instance_ids=ids
        ),
    )
    assert len({r.instance for r in nospill.records}) == 1
    # 1 ms apart, the second waits for the first's prefill on its holder (about 0.25 s at
    # the rate assumed before any is learned) rather than compute it again elsewhere (0.25 s,
    # counted miss_weight times: it would delay whatever queues behind it there) ...
    assert spill.records[0].instance == spill.records[1].instance
    # ... until the holder has more in flight than load_factor x the mean + 2
    assert len({r.instance for r in spill.records}) > 1


RESIZE_AT = 7.5
"""Half way through the resize tests' 2,400 arrivals at 160 requests/s."""


def test_a_new_instance_moves_no_prefix_and_load_brings_it_requests() -> None:
    workload = generate(
        "system-prompt",
        {
            "requests": 2400,
            "rate": 160.0,
            "prompts": 120,
            "prompt_tokens": 300,
            "output_min": 1,
            "output_max": 2,
        },
    )
    result = simulate(
        workload,
        DesSettings(
            policy=Policy.PREFIX,
            engine=ROOMY,
            router=RouterConfig(),
            instances=4,
            resizes=(Resize(RESIZE_AT, +1),),
        ),
    )
    before: dict[str, set[str | None]] = defaultdict(set)
    after: dict[str, set[str | None]] = defaultdict(set)
    for arrival, record in zip(workload, result.records, strict=True):
        (before if record.arrival_s < RESIZE_AT else after)[arrival.group].add(record.instance)
    new = Instance.from_url(default_instance_url(4)).id
    assert new not in {r.instance for r in result.records if r.arrival_s < RESIZE_AT}
    assert all(len(s) == 1 for s in (*before.values(), *after.values()))
    assert all(after[g] == before[g] for g in before if g in after)  # caches kept
    assert result.events and result.events[0][1] == "+1 -> 5 instances"
    # with the defaults, load brings it requests: only those whose holders are busier than
    # their cache saves (at 40 requests/s none are: the cached instances are the quicker)
    spill = simulate(
        workload,
        DesSettings(
            policy=Policy.PREFIX_SPILL,
            engine=ROOMY,
            router=RouterConfig(),
            instances=4,
            resizes=(Resize(RESIZE_AT, +1),),
        ),
    )
    late = [r.instance for r in spill.records if r.arrival_s >= RESIZE_AT]
    assert late.count(new) > 0


def test_resize_parsing() -> None:
    assert parse_resizes("600:-8, 300:+16") == (Resize(300.0, 16), Resize(600.0, -8))
    with pytest.raises(ValueError, match="TIME"):
        parse_resizes("soon:+1")


def test_policies_map_to_router_configs_and_all_means_the_four_compared_by_default() -> None:
    from bench.policies import ALL_POLICIES, parse_policies
    from prefix_router.core.config import PrefixMatch, SpillPolicyName

    assert parse_policies("all") == ALL_POLICIES and Policy.PREFIX_FIXED not in ALL_POLICIES
    assert parse_policies("all,prefix-fixed") == (*ALL_POLICIES, Policy.PREFIX_FIXED)
    base = RouterConfig()
    assert Policy.PREFIX_SPILL.router_config(base) == base  # the defaults, as users run them
    assert Policy.PREFIX.router_config(base).spill.policy is SpillPolicyName.NONE
    fixed = Policy.PREFIX_FIXED.router_config(base)
    assert (fixed.prefix_match, fixed.prefix_length) == (PrefixMatch.FIXED, 1024)
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policies("prefix,fastest")
