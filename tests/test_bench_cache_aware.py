"""The cache-aware comparator (SGLang model gateway's policy): tree, thresholds, picks."""

from __future__ import annotations

from collections import defaultdict

import pytest

from bench.cache_aware import (
    CHUNK_CHARS,
    DEFAULTS,
    ApproximateTree,
    CacheAwareRouter,
    CacheAwareSettings,
    imbalanced,
    routing_text,
)
from bench.des import DesSettings, simulate
from bench.policies import Policy
from bench.spec import request_body
from bench.workloads import generate
from prefix_router.core.config import RouterConfig
from vllm_sim.config import make_config

A = "a" * (10 * CHUNK_CHARS)
B = "b" * (10 * CHUNK_CHARS)


def test_documented_defaults() -> None:
    assert (
        DEFAULTS.cache_threshold,
        DEFAULTS.balance_abs_threshold,
        DEFAULTS.balance_rel_threshold,
        DEFAULTS.eviction_interval_s,
        DEFAULTS.max_tree_size,
    ) == (0.3, 64, 1.5, 120.0, 67_108_864)


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([0, 0, 0], False),
        ([0, 64, 10], False),  # max - min = 64: not above the absolute threshold
        ([0, 65, 10], True),
        ([110, 175, 120], True),  # 65 apart and 175 > 1.5 x 110 = 165
        ([130, 195, 140], False),  # 65 apart but 195 = 1.5 x 130: not above
        ([300, 400, 350], False),  # 100 apart but 400 < 1.5 x 300
    ],
)
def test_imbalance_needs_both_thresholds(loads: list[int], expected: bool) -> None:
    assert imbalanced(loads, DEFAULTS) is expected


@pytest.mark.parametrize(
    ("inserted", "text", "matched", "holder"),
    [
        ([], A, 0, None),
        ([(A, "w1", 1.0)], A, len(A), "w1"),
        ([(A, "w1", 1.0)], A + B, len(A), "w1"),
        ([(A, "w1", 1.0)], A[:-1] + "x" + B, len(A) - CHUNK_CHARS, "w1"),  # whole chunks
        ([(A, "w1", 1.0)], B, 0, None),
        ([(A, "w1", 1.0), (A + B, "w2", 2.0)], A + B, len(A + B), "w2"),
        ([(A + B, "w2", 1.0), (A, "w1", 2.0)], A + "b" * 8, len(A), "w1"),  # seen last
    ],
)
def test_longest_prefix_and_its_holder(
    inserted: list[tuple[str, str, float]], text: str, matched: int, holder: str | None
) -> None:
    tree = ApproximateTree()
    for t, worker, now in inserted:
        tree.insert(t, worker, now)
    assert tree.match(text) == (matched, holder)


def test_sizes_count_each_workers_text_once() -> None:
    tree = ApproximateTree()
    tree.insert(A, "w1", 1.0)
    tree.insert(A + B, "w1", 2.0)
    tree.insert(A, "w2", 3.0)
    assert tree.sizes == {"w1": len(A + B), "w2": len(A)}
    assert tree.smallest(["w1", "w2", "w3"]) == "w3"
    assert tree.smallest(["w1", "w2"]) == "w2"


def test_eviction_drops_the_least_recently_used_text_of_workers_over_the_limit() -> None:
    tree = ApproximateTree()
    tree.insert(A, "w1", 1.0)
    tree.insert(B, "w1", 2.0)
    tree.insert(A, "w2", 3.0)
    tree.evict(max_size=len(B))
    assert tree.sizes == {"w1": len(B), "w2": len(A)}
    assert tree.match(B) == (len(B), "w1")
    assert tree.match(A) == (len(A), "w2")  # w2's copy of A stays
    tree.forget("w2")
    assert tree.match(A) == (0, None) and not tree.root.children.get(A[:CHUNK_CHARS])


def test_eviction_trims_a_text_from_its_end() -> None:
    tree = ApproximateTree()
    tree.insert(A + B, "w1", 1.0)
    tree.evict(max_size=len(A))
    assert tree.sizes["w1"] == len(A) and tree.match(A + B) == (len(A), "w1")


@pytest.mark.parametrize(
    ("history", "loads", "text", "expected"),
    [
        # balanced, more than 30% of the text held: the holder
        ([(A, "w1")], {"w1": 5, "w2": 0}, A + B[: len(A) // 2], "w1"),
        # balanced, 30% or less held: the smallest tree (w2 holds nothing)
        ([(A, "w1")], {"w1": 0, "w2": 0}, A + B * 3, "w2"),  # 25% held
        # imbalanced: the least loaded, whoever holds the text
        ([(A, "w1")], {"w1": 80, "w2": 10}, A, "w2"),
        # nothing held anywhere: the smallest tree, the first of equals
        ([], {"w1": 0, "w2": 0}, A, "w1"),
    ],
)
def test_pick(
    history: list[tuple[str, str]], loads: dict[str, int], text: str, expected: str
) -> None:
    router = CacheAwareRouter()
    for t, worker in history:
        router.tree.insert(t, worker, 0.0)
    assert router.pick(text, loads, now=1.0) == expected
    assert router.tree.match(text) == (len(text), expected)  # recorded where it went


def test_pick_evicts_every_interval() -> None:
    router = CacheAwareRouter(CacheAwareSettings(max_tree_size=len(A), eviction_interval_s=10))
    router.pick(A, {"w1": 0}, now=0.0)
    router.pick(B, {"w1": 0}, now=5.0)
    assert router.tree.sizes["w1"] == len(A + B)  # not yet
    router.pick(B, {"w1": 0}, now=10.0)
    assert router.tree.sizes["w1"] == len(B) and router.tree.match(A) == (0, None)


def test_routing_text_is_what_the_model_reads() -> None:
    workload = generate("chat", {"requests": 20})
    conversation = next(a for a in workload if len(a.turns) > 1)
    first = routing_text(request_body(conversation.turns[0], model="m"))
    history = (*conversation.turns[0].messages, ("assistant", "an answer"))
    second = routing_text(request_body(conversation.turns[1], model="m", history=history))
    assert first.startswith("You are a helpful assistant.") and second.startswith(first + "\n")
    code = next(iter(generate("code", {"requests": 1})))
    assert routing_text(request_body(code.turns[0], model="m")) == code.turns[0].prompt


def test_in_the_simulation_a_shared_prompt_stays_with_its_first_worker_at_light_load() -> None:
    workload = generate(
        "system-prompt",
        {
            "requests": 60,
            "rate": 2.0,
            "prompts": 4,
            "prompt_tokens": 600,
            "user_max": 60,
            "output_min": 2,
            "output_max": 4,
        },
    )
    result = simulate(
        workload,
        DesSettings(
            policy=Policy.CACHE_AWARE,
            router=RouterConfig(),
            engine=make_config(num_gpu_blocks=4096),
            instances=4,
        ),
    )
    homes: dict[str, set[str | None]] = defaultdict(set)
    for arrival, record in zip(workload, result.records, strict=True):
        homes[arrival.group].add(record.instance)
    assert result.errors == 0 and all(len(h) == 1 for h in homes.values())
    assert len({next(iter(h)) for h in homes.values()}) == 4  # new prompts: the emptiest tree
    with pytest.raises(ValueError, match="simulation only"):
        from bench.live import LiveSettings, policy_stack

        with policy_stack(
            Policy.CACHE_AWARE, [], LiveSettings(router=RouterConfig()), run_dir=None
        ):  # type: ignore[arg-type]
            pass
