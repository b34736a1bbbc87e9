"""The one decision function: table tests of choose(), and decide() over a small fleet."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import orjson
import pytest

from prefix_router.core.config import PrefixMode, RouterConfig, SpillPolicyName
from prefix_router.core.decision import (
    IN_FLIGHT_SLACK,
    Candidate,
    Decision,
    DecisionRule,
    Outcome,
    choose,
    in_flight_bound,
    release_writes,
)
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.index import CacheModel, InProcessIndex, entries, locate
from prefix_router.core.key import KeySettings, PrefixKey, extract_key
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import MAX_WAITING_TRACKED, InstanceModel, InstanceWork, admit

RULE = DecisionRule(
    policy=SpillPolicyName.LEAST_WORK,
    threshold=4,
    load_factor=1.25,
    placement_width=4,
    slots_log2=12,
)
MISS_3 = dataclasses.replace(RULE, miss_weight=3.0)
NO_THRESHOLD = dataclasses.replace(RULE, threshold=None)
NO_SPILL = DecisionRule(
    policy=SpillPolicyName.NONE, threshold=4, load_factor=1.25, placement_width=4, slots_log2=12
)


def c(cached: int = 0, backlog: float = 0.0, waiting: int = 0, in_flight: int = 0) -> Candidate:
    return Candidate(0, cached, backlog, waiting, in_flight, rate=1000.0)


@pytest.mark.parametrize(
    ("rule", "candidates", "bound", "expected"),
    [
        # the holder wins while its queue is shorter than what its cache saves
        (RULE, [c(cached=900, backlog=0.5), c()], 9, 0),
        # ... and loses once the queue is longer: 1.0 + 0.1 > 0 + 1.0
        (RULE, [c(cached=900, backlog=1.0), c()], 9, 1),
        # ties go to the earlier candidate, then to fewer in flight
        (RULE, [c(), c()], 9, 0),
        (RULE, [c(in_flight=2), c(in_flight=1)], 9, 1),
        # ConcurrencyThreshold: 4 waiting is overloaded, whatever its cache ...
        (RULE, [c(cached=999, waiting=4), c(backlog=0.5)], 9, 1),
        # ... and by default there is no threshold
        (NO_THRESHOLD, [c(cached=999, waiting=400), c(backlog=0.5)], 9, 0),
        (NO_THRESHOLD, [c(waiting=400), c(waiting=3, backlog=0.1)], 9, 0),
        # the in-flight bound keeps a holder from taking more than its share
        (RULE, [c(cached=999, in_flight=3), c(in_flight=1)], 3, 1),
        # over the bound beats over the threshold; all overloaded: the shortest wait
        (RULE, [c(waiting=4), c(in_flight=5, backlog=2.0)], 3, 1),
        (RULE, [c(waiting=5, backlog=2.0), c(waiting=4, backlog=1.0)], 3, 1),
        # a miss counts miss_weight times the extra prefill: 1.0 + 0.1 < 1.0 + 0.1 + 2 x 0.9
        (MISS_3, [c(cached=900, backlog=1.0), c()], 9, 0),
        (MISS_3, [c(cached=900, backlog=2.9), c()], 9, 1),
        # ... never between candidates that need the same prefill
        (MISS_3, [c(backlog=0.2), c(backlog=0.1)], 9, 1),
        # no spill: the deepest holder, whatever its queue; a new prefix: the least backlog
        (NO_SPILL, [c(cached=100, backlog=9.0, waiting=9), c()], 1, 0),
        (NO_SPILL, [c(backlog=0.2), c(backlog=0.1)], 1, 1),
        # ... and a prefix every instance holds (a shared system prompt) is a new prefix
        (NO_SPILL, [c(cached=100, backlog=0.2), c(cached=100, backlog=0.1)], 1, 1),
    ],
)
def test_choose(
    rule: DecisionRule, candidates: list[Candidate], bound: float, expected: int
) -> None:
    assert choose(candidates, 1000, rule, bound) == expected


BUSY_AWARE = dataclasses.replace(
    NO_THRESHOLD, miss_weight=100.0, idle_miss_weight=10.0, busy_backlog_s=0.2
)


@pytest.mark.parametrize(
    ("median_backlog_s", "weight"), [(0.0, 10), (0.05, 32.5), (0.1, 55), (0.2, 100), (9, 100)]
)
def test_a_miss_counts_more_as_the_median_candidate_queues_more(
    median_backlog_s: float, weight: float
) -> None:
    assert BUSY_AWARE.miss_weight_at(median_backlog_s) == pytest.approx(weight)


def test_the_idle_weight_is_never_above_the_busy_one() -> None:
    low = dataclasses.replace(BUSY_AWARE, miss_weight=3.0)
    assert low.miss_weight_at(0.0) == low.miss_weight_at(1.0) == 3.0
    assert dataclasses.replace(BUSY_AWARE, idle_miss_weight=None).miss_weight_at(0.0) == 100


@pytest.mark.parametrize(
    ("others_backlog", "expected"),
    [
        # a burst on the holder while the rest of the fleet is idle: the median candidate
        # has nothing queued, a miss counts 10x, and an idle instance computes it sooner
        # (2.0 + 0.9 s at the holder against 1.0 + 9 x 0.1 s)
        (0.0, 1),
        # the fleet busy (the median has 0.5 s queued): a miss counts 100x and the request
        # stays on its cache (2.9 s against 0.5 + 1.0 + 99 x 0.1 s)
        (0.5, 0),
    ],
)
def test_a_holder_keeps_its_requests_unless_the_fleet_has_prefill_to_spare(
    others_backlog: float, expected: int
) -> None:
    holder = c(cached=100, backlog=2.0)
    others = [c(backlog=others_backlog) for _ in range(4)]
    assert choose([holder, *others], 1000, BUSY_AWARE, 99) == expected


def test_the_default_rule_keeps_cache_hits_home_and_has_no_threshold() -> None:
    rule = DecisionRule.from_config(RouterConfig())
    assert rule.threshold is None and rule.waiting_kept == MAX_WAITING_TRACKED
    assert rule.miss_weight == 100
    assert (rule.idle_miss_weight, rule.busy_backlog_s) == (10, 0.2)
    # a holder with 5 s of queue keeps a request its cache saves 50 tokens, 0.05 s (x 100)
    holder, idle = c(cached=50, backlog=4.9, waiting=300), c()
    assert choose([holder, idle], 1000, rule, 99) == 0
    assert choose([c(cached=50, backlog=5.1), idle], 1000, rule, 99) == 1


@pytest.mark.parametrize(
    ("value", "expected"), [("off", None), ("None", None), (None, None), ("64", 64), (64, 64)]
)
def test_concurrency_threshold_is_a_count_or_off(value: object, expected: int | None) -> None:
    assert (
        RouterConfig.model_validate({"concurrency_threshold": value}).concurrency_threshold
        == expected
    )


def test_the_in_flight_bound_follows_the_fleet_mean() -> None:
    assert in_flight_bound(RULE, 0, 4) == pytest.approx(2)
    assert in_flight_bound(RULE, 40, 8) == pytest.approx(1.25 * 5 + 2)
    assert IN_FLIGHT_SLACK == 2


# -- decide() over a fleet ---------------------------------------------------------------------

FLEET = Fleet.of([Instance("10.0.0.1", 8000 + i) for i in range(4)])
CONFIG = RouterConfig().patched(
    {"prefix_mode": "bytes", "index": {"slots_log2": 12}, "concurrency_threshold": 4}
)
TABLE = RoutingTable.build(FLEET, CONFIG)
MODEL = InstanceModel(prefill_tokens_per_s=1000.0, kv_cache_tokens=100_000)


@dataclass
class Fleetwide:
    """A FleetView over plain dicts, applying each decision as a store would."""

    table: RoutingTable = TABLE
    now: float = 0.0
    index: InProcessIndex = field(default_factory=lambda: InProcessIndex(12))
    works: dict[int, InstanceWork] = field(default_factory=dict)
    flights: dict[int, int] = field(default_factory=dict)
    capacity: float = 100_000
    path: str = "/x"

    def slot(self, slot: int) -> bytes:
        return self.index.read(slot)

    def work(self, instance: int) -> InstanceWork:
        return self.works.get(instance, InstanceWork())

    def model(self, instance: int) -> InstanceModel:
        return InstanceModel(MODEL.prefill_tokens_per_s, self.capacity)

    def in_flight(self, instance: int) -> int:
        return self.flights.get(instance, 0)

    def load(self, instance: int) -> tuple[float, int, int, float]:
        work = self.work(instance)
        return (
            work.backlog_s(self.now),
            work.waiting(self.now),
            self.in_flight(instance),
            self.model(instance).prefill_tokens_per_s,
        )

    def total_in_flight(self) -> int:
        return sum(self.flights.values())

    def cache_model(self, tag: int) -> CacheModel | None:
        i = self.table.instance_of_tag.get(tag)
        return None if i is None else CacheModel.of(self.work(i).written_tokens, self.capacity)

    def route(self, body: bytes, *, hold: bool = False) -> Decision:
        d, _ = self.table.decide(self.key(body), self)
        for write in d.index_writes:
            self.index.write(write)
        self.works[d.instance] = admit(
            self.work(d.instance),
            self.now,
            prefill_tokens=d.prefill_tokens,
            written_tokens=d.written_tokens,
            rate=MODEL.prefill_tokens_per_s,
        )
        if hold:
            self.flights[d.instance] = self.in_flight(d.instance) + 1
        return d

    def key(self, body: bytes) -> PrefixKey:
        return extract_key(body, settings=self.table.key_settings, path=self.path)


def text(name: str, size: int) -> bytes:
    return (name.encode() * size)[:size]


def test_a_new_prefix_is_placed_on_an_idle_ring_candidate_then_found_there() -> None:
    fleet = Fleetwide()
    first = fleet.route(text("doc-a", 4000))
    assert first.outcome is Outcome.PLACED
    assert first.instance == fleet.table.ring_order(fleet.key(text("doc-a", 4000)).value)[0]
    fleet.now = 100.0  # the queue has drained
    again = fleet.route(text("doc-a", 4000) + b"question two")
    assert again.outcome is Outcome.HOME and again.instance == first.instance
    # the deepest block inside the shared 4000 B ends at 3072; the holder is credited half
    # of the next block too (to 4012): what it served went on past the block
    assert again.cached_tokens == (3072 + (4012 - 3072) // 2) // 4
    assert again.prefill_tokens == again.written_tokens - 256 == (4012 // 4) - 885


def test_a_growing_conversation_follows_its_earlier_turns() -> None:
    fleet = Fleetwide()
    turn = text("conversation", 1500)
    where = fleet.route(turn).instance
    for n in range(5):
        fleet.now += 10
        turn += text(f"answer and question {n}", 700)
        d = fleet.route(turn)
        assert (d.outcome, d.instance) == (Outcome.HOME, where)


def chat_body(*messages: tuple[str, str]) -> bytes:
    return orjson.dumps(
        {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    )


def test_a_conversation_goes_where_its_last_turn_and_the_answer_to_it_are_cached() -> None:
    config = CONFIG.patched({"prefix_mode": "openai"})
    fleet = Fleetwide(table=RoutingTable.build(FLEET, config), path="/v1/chat/completions")
    system = ("system", "s" * 6000)  # shared by every conversation: every instance has it
    for n in range(8):
        fleet.route(chat_body(system, ("user", f"conversation {n}")), hold=True)
    fleet.flights.clear()
    fleet.now = 100.0
    turn = (system, ("user", "u" * 600))
    first = fleet.route(chat_body(*turn))
    fleet.now = 200.0
    answer = ("assistant", "a" * 2000)
    second = fleet.route(chat_body(*turn, answer, ("user", "next question")))
    assert (second.outcome, second.instance) == (Outcome.HOME, first.instance)
    # the first turn's whole prompt and the answer generated to it, as the key renders them
    rendered = "m\x1e\x1esystem\x1f" + "s" * 6000 + "\x1euser\x1f" + "u" * 600
    rendered += "\x1eassistant\x1f" + "a" * 2000
    assert second.cached_tokens == len(rendered) // 4


@pytest.mark.parametrize(
    ("others_busy_s", "keeps_s", "spills_s"),
    [
        # the rest of the fleet idle: the holder's cache saves 1,768 tokens, 1.8 s at
        # 1,000 tokens/s, which counts 10 times (idle_miss_weight) ...
        (0.0, 17.0, 18.0),
        # ... and 100 times (miss_weight) when the other instances have prefill queued
        (1.0, 170.0, 180.0),
    ],
)
def test_a_busy_holder_loses_to_an_idle_instance_when_its_queue_outweighs_its_cache(
    others_busy_s: float, keeps_s: float, spills_s: float
) -> None:
    fleet = Fleetwide()
    home = fleet.route(text("hot", 8000)).instance
    fleet.now = 1000.0
    for i in range(len(FLEET.instances)):
        if i != home and others_busy_s:
            fleet.works[i] = InstanceWork(fleet.now + others_busy_s, (fleet.now + others_busy_s,))
    fleet.works[home] = InstanceWork(busy_until=fleet.now + keeps_s, ends=(fleet.now + keeps_s,))
    assert fleet.route(text("hot", 8000) + b"!").outcome is Outcome.HOME
    fleet.works[home] = InstanceWork(busy_until=fleet.now + spills_s, ends=(fleet.now + spills_s,))
    d = fleet.route(text("hot", 8000) + b"?")
    assert d.outcome is Outcome.SPILLED and d.instance != home
    assert d.cached_tokens == 0 and d.prefill_tokens == 8001 // 4


def test_when_every_candidate_is_over_the_threshold_the_ring_offers_more() -> None:
    """ConcurrencyThreshold (4 here): a holder with 4 requests waiting for their first
    token takes no new one while another instance can, even with few in flight; with one
    ring candidate (placement width 1) the next ones on the ring are asked."""
    table = RoutingTable.build(FLEET, CONFIG.patched({"placement": {"width": 1}}))
    fleet = Fleetwide(table=table)
    home = fleet.route(text("hot", 8000)).instance
    fleet.now = 1000.0
    ends = tuple(fleet.now + 0.01 * n for n in range(1, 5))  # 4 waiting, briefly
    fleet.works[home] = InstanceWork(busy_until=ends[-1], ends=ends)
    assert fleet.in_flight(home) == 0  # under the in-flight bound: only the threshold binds
    # the same prompt again: its one ring candidate is its holder
    assert fleet.table.ring_order(fleet.key(text("hot", 8000)).value)[0] == home
    d = fleet.route(text("hot", 8000))
    assert d.outcome is Outcome.SPILLED and d.instance != home
    fleet.works[home] = InstanceWork(busy_until=ends[-2], ends=ends[:-1])  # 3 waiting
    assert fleet.route(text("hot", 8000)).instance == home


def test_an_instance_that_wrote_more_than_its_cache_holds_has_forgotten() -> None:
    fleet = Fleetwide(capacity=10_000)
    home = fleet.route(text("old", 4000)).instance
    fleet.now = 100.0
    w = fleet.work(home)
    fleet.works[home] = InstanceWork(w.busy_until, w.ends, w.written_tokens + 10_000)
    assert fleet.route(text("old", 4000) + b"?").outcome is Outcome.PLACED


@pytest.mark.parametrize(
    ("written_while_answering", "stamped_again"),
    # the request itself wrote 1,256 tokens (its 1,000-token prompt and 256 of answer); a
    # quarter of the 10,000-token cache is 2,500
    [(0, False), (1_200, False), (1_300, True), (50_000, True)],
)
def test_a_request_that_ends_stamps_its_blocks_again_once_a_quarter_stale(
    written_while_answering: int, stamped_again: bool
) -> None:
    fleet = Fleetwide(capacity=10_000)
    body = text("conversation", 4000)
    home = fleet.route(body).instance
    w = fleet.work(home)
    fleet.works[home] = InstanceWork(
        w.busy_until, w.ends, w.written_tokens + written_while_answering
    )
    blocks, tag = fleet.key(body).blocks, TABLE.tags[home]
    writes = release_writes(blocks, tag, fleet, slots_log2=12)
    assert len(writes) == (len(blocks) if stamped_again else 0)
    for write in writes:
        fleet.index.write(write)
    now = fleet.cache_model(tag)
    assert now is not None
    stamps = {s for b in blocks for t, _, s in entries(fleet.slot(locate(b, 12)[0])) if t == tag}
    assert (stamps == {now.stamp}) is stamped_again
    # found where it was: after 50,000 tokens written, only thanks to the writes (without
    # them: test_an_instance_that_wrote_more_than_its_cache_holds_has_forgotten)
    fleet.now = 100.0
    assert fleet.route(body + b"?").outcome is Outcome.HOME


def test_a_request_that_ends_on_a_departed_instance_writes_nothing() -> None:
    fleet = Fleetwide()
    body = text("conversation", 4000)
    home = fleet.route(body).instance
    smaller = Fleet.of([i for n, i in enumerate(FLEET.instances) if n != home], version=2)
    fleet.table = RoutingTable.build(smaller, CONFIG)
    assert release_writes(fleet.key(body).blocks, TABLE.tags[home], fleet, slots_log2=12) == ()


def test_a_departed_instance_holds_nothing() -> None:
    fleet = Fleetwide()
    home = fleet.route(text("doc-b", 4000)).instance
    smaller = Fleet.of([i for n, i in enumerate(FLEET.instances) if n != home], version=2)
    fleet.table = RoutingTable.build(smaller, CONFIG)
    fleet.now = 100.0
    d = fleet.route(text("doc-b", 4000) + b"?")
    assert d.outcome is Outcome.PLACED


def test_a_prefix_every_way_holds_counts_as_cached_everywhere() -> None:
    # three of four instances over the in-flight bound at once needs load_factor < 4/3
    fleet = Fleetwide(
        table=RoutingTable.build(FLEET, CONFIG.patched({"spill": {"load_factor": 1.25}}))
    )
    system = text("shared system prompt", 3000)
    placed = []
    for n in range(4):  # each holder over the in-flight bound in turn
        placed.append(fleet.route(system + text(f"user {n}", 600)))
        fleet.flights[placed[-1].instance] = 100
    assert len({d.instance for d in placed}) == 4
    fleet.flights.clear()
    fleet.now = 100.0
    d = fleet.route(system + b"a new conversation")
    # every instance holds the blocks to 2048, and half the next one (to 3018)
    assert d.outcome is Outcome.PLACED and d.cached_tokens == (2048 + (3018 - 2048) // 2) // 4


def test_fixed_mode_keys_only_the_first_prefix_length_bytes() -> None:
    config = CONFIG.patched({"prefix_match": "fixed", "prefix_length": 1024})
    fleet = Fleetwide(table=RoutingTable.build(FLEET, config))
    assert fleet.table.key_settings == KeySettings(
        prefix_length=1024, mode=PrefixMode.BYTES, max_parse_bytes=4 * 1024 * 1024, block_bytes=0
    )
    first = fleet.route(text("same head", 1024) + b"one")
    fleet.now = 100.0
    second = fleet.route(text("same head", 1024) + b"two, different")
    assert second.instance == first.instance and second.cached_tokens == 256
