"""The routing decision of one request: every path that routes calls :func:`decide`.

filter -> score -> pick, over a handful of candidates:

candidates
    The instances that hold part of the request's prefix (from the prefix index, deepest
    first), then the first ``placement_width`` instances of the key's ring order (where a
    prefix nobody holds may start). Each carries what it caches of the prompt and its
    modelled prefill queue (:mod:`.work`). If the filter drops them all, the key's further
    ring successors join (up to 16), so a hot prefix spreads over the whole fleet.
filter
    Drop overloaded instances: more requests in flight than ``load_factor`` times the
    fleet's mean (bounded-load consistent hashing: no instance takes far more than its
    share of the requests, and a prefix hotter than one instance spreads over several),
    or, when the operator sets ConcurrencyThreshold, that many requests waiting for their
    first token. If that drops every candidate, the in-flight bound is lifted, then the
    threshold.

    ConcurrencyThreshold is off by default because every way of leaving a holder while
    the fleet is uniformly busy costs more than it saves: the request waits as long
    elsewhere and computes its prefix again there, lengthening that queue and crowding
    the fleet's caches with copies. In the simulation (bench/results/spill_variants.md)
    a threshold of 256 waiting collapsed RAG at 150 and 188 requests/s (P50 3-24 s, also
    when bounded by the fleet's mean waiting) where no threshold served 188 at 263 ms,
    and it changed nothing on the hot prefix or the trace-like workload, which the
    in-flight bound spreads.
score
    The request's expected wait for its first token there, the prefill queued before it
    plus its own uncached prefill, ``backlog_s + (prompt - cached) / rate``, plus what the
    fleet pays for a miss: the prefill beyond the least any candidate needs delays every
    request that queues behind it there, and every later request of the prefix, which
    now has a copy to fill in one more cache, so it counts ``miss_weight`` times (100)
    when the fleet is busy. Cache and load are weighed in one unit: a holder wins unless
    its queue is longer than what its cache saves a hundred times over. With a weight of
    3, requests left their holders for each other's instances near capacity, each
    computing a 4,000-token document again, until every queue was long (a spill cascade:
    RAG in the simulation served 88 requests/s within its TTFT objective; 188 with 100
    and no threshold, as pure affinity does).

    How busy the fleet is, is read from the median candidate's queued prefill: with
    nothing queued there a miss counts ``idle_miss_weight`` (10), rising linearly to
    ``miss_weight`` at ``busy_backlog_s`` (200 ms). A burst that lands on one instance
    (a conversation's holder, a hot document's) leaves the median idle, and the requests
    queued behind it go to instances that can compute their misses at once; when most
    instances are busy, recomputing is what the fleet cannot afford, and every request
    stays on its cache. The median, not the mean: the burst's own queue would lift the
    mean. (A fleet serving five kinds of traffic at once, `mixed` in the simulation: P99
    TTFT 1.5-3.5 s with a fixed weight of 100 and 1.2-1.5 s with this, the hit rate at
    99-100% of the bound; a fixed weight of 10 did as well there but collapsed RAG and code
    at their capacity, where this rule keeps them.)
pick
    The lowest score; ties go to the earlier candidate (the deeper holder, or the ring's
    order), so with no load the result is plain prefix affinity and consistent hashing.

With ``spill: none`` the deepest holder always wins (and a new prefix still starts on the
least loaded ring candidate): pure affinity, for comparison.

The decision also says what to write: the chosen instance now holds the request's blocks
(:func:`.index.record` per block) and has its prefill queued (:func:`.work.admit`). The
stores apply those writes: in process, or in Redis for every ext_proc replica. When the
request ends, its blocks are stamped again (:func:`release_writes`): the instance used them
until then.

Cost: O(blocks x ways) to read the index, O(candidates) to decide.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

from prefix_router.core.config import PrefixMatch, RouterConfig, SpillPolicyName
from prefix_router.core.index import (
    CacheModel,
    EntryWrite,
    ModelOf,
    apply,
    match,
    record,
)
from prefix_router.core.key import BYTES_PER_TOKEN, PrefixKey
from prefix_router.core.work import MAX_WAITING_TRACKED, Load


class Outcome(StrEnum):
    """Why a request went where it went; the label of the decisions metric."""

    HOME = "home"
    """To an instance holding the longest prefix of the request the fleet holds."""
    PLACED = "placed"
    """Nobody holds its prefix: the least loaded of its ring candidates."""
    SPILLED = "spilled"
    """Away from the prefix's holders: their queues outweighed their cache."""
    RING_ONLY = "ring_only"
    """Fleet-wide state unavailable (Redis slow or down): decided on this replica's own."""
    NO_INSTANCES = "no_instances"
    UNKNOWN_MODEL = "unknown_model"
    """No instance serves the request's model: answered 404 by ext_proc (:mod:`.pools`)."""


@dataclass(frozen=True, slots=True)
class DecisionRule:
    """The settings one decision needs; built once per config."""

    policy: SpillPolicyName
    threshold: int | None
    """ConcurrencyThreshold: requests waiting for their first token that make an instance
    overloaded (None: no such limit). The waiting count is the view's
    (:meth:`~prefix_router.core.work.InstanceModel.waiting_with`)."""
    load_factor: float
    """No instance above this times the fleet's mean in-flight requests (plus
    :data:`IN_FLIGHT_SLACK`)."""
    placement_width: int
    """Ring candidates a prefix nobody holds may start on."""
    slots_log2: int
    miss_weight: float = 1.0
    """How many times the prefill a candidate adds beyond the least any candidate needs
    counts in its score (:func:`choose`) when the fleet is busy."""
    idle_miss_weight: float | None = None
    """What it counts when the median candidate has no prefill queued (None: as busy)."""
    busy_backlog_s: float = 0.2
    """The median candidate's queued prefill at which a miss counts ``miss_weight``."""

    def miss_weight_at(self, median_backlog_s: float) -> float:
        """What a miss counts when the median candidate has ``median_backlog_s`` of
        prefill queued: ``idle_miss_weight`` at none, rising linearly to ``miss_weight`` at
        ``busy_backlog_s`` and above (never more than ``miss_weight``)."""
        busy = self.miss_weight
        idle = busy if self.idle_miss_weight is None else min(self.idle_miss_weight, busy)
        if median_backlog_s >= self.busy_backlog_s:
            return busy
        return idle + (busy - idle) * max(0.0, median_backlog_s) / self.busy_backlog_s

    @property
    def waiting_limit(self) -> float:
        """Waiting requests at which an instance is overloaded (infinite: no threshold)."""
        return math.inf if self.threshold is None else float(self.threshold)

    @property
    def waiting_kept(self) -> int:
        """Prefill ends the stores keep per instance: enough to tell the threshold."""
        return MAX_WAITING_TRACKED if self.threshold is None else self.threshold

    @classmethod
    def from_config(cls, config: RouterConfig) -> DecisionRule:
        return cls(
            policy=config.spill.policy,
            threshold=config.concurrency_threshold,
            load_factor=config.spill.load_factor,
            placement_width=config.placement.width,
            slots_log2=config.index.slots_log2,
            miss_weight=config.spill.miss_weight,
            idle_miss_weight=config.spill.idle_miss_weight,
            busy_backlog_s=config.spill.busy_backlog_ms / 1000,
        )


def block_bytes(config: RouterConfig) -> int:
    """Bytes per index block: the whole prefix for a fixed key."""
    if config.prefix_match is PrefixMatch.FIXED:
        return config.prefix_length
    return config.index.block_bytes


class FleetView(Protocol):
    """What a decision reads of the fleet's shared state, as of ``now``."""

    now: float

    def slot(self, slot: int) -> bytes:
        """One slot of the prefix index."""
        ...

    def load(self, instance: int) -> Load:
        """Instance ``instance``'s :data:`Load` (an index into the table's instances)."""
        ...

    def total_in_flight(self) -> int:
        """Requests in flight on the whole fleet."""
        ...

    def cache_model(self, tag: int) -> CacheModel | None:
        """The cache model of the instance with identity tag ``tag`` (None: not in the fleet)."""
        ...


class Candidate(NamedTuple):
    instance: int
    cached_tokens: int
    backlog_s: float
    waiting: int
    in_flight: int
    rate: float

    def expected_wait_s(self, prompt_tokens: int) -> float:
        """Seconds until the request's first token here: queued prefill, then its own."""
        return self.backlog_s + max(0, prompt_tokens - self.cached_tokens) / self.rate


class Decision(NamedTuple):
    """Where one request goes, why, and what routing it there changes."""

    outcome: Outcome
    instance: int
    """Index into the table's instances."""
    home: int | None
    """The instance holding the longest prefix (None: nobody holds more than the common
    part), where the request would go without load."""
    cached_tokens: int
    """Tokens of the prompt the chosen instance is expected to have cached."""
    prefill_tokens: int
    written_tokens: int
    index_writes: tuple[EntryWrite, ...]


IN_FLIGHT_SLACK = 2
"""Requests an instance may hold over ``load_factor`` times the fleet's mean."""


def in_flight_bound(rule: DecisionRule, total_in_flight: int, fleet_size: int) -> float:
    """In-flight requests at or above which an instance takes no more (while others can):
    ``load_factor`` times the fleet's mean, plus :data:`IN_FLIGHT_SLACK`. The slack keeps a
    lightly loaded fleet from scattering a conversation's turns or a prefix's concurrent
    requests for differences of a request or two, which cost nothing to serve where their
    cache is (in the simulation of 6-turn chats at 8 requests/s over 8 instances, a bound
    of 1.25 x (mean + 1) spilled enough turns to raise P99 TTFT from 69 to 161 ms); under
    load the factor dominates, as in bounded-load consistent hashing.

    2, not the 4 of earlier versions (bench/scripts/routing_at_load.py, 70B instances at
    60% of round robin's capacity, seeds 1-3): at ~5 requests in flight per instance, + 4
    let a hot prefix's holder carry 1.49-1.58x the mean share of requests; + 2 holds it to
    1.04-1.06x with P50 and P99 TTFT as low or lower, the mix 1.20-1.26x -> 1.07-1.11x,
    code 1.20-1.25x -> 1.10-1.26x (seeds 3-6); chat and long-system-chat unchanged at that
    load and at 8 requests/s (P50 40.6 ms, P99 56 either way)."""
    return rule.load_factor * total_in_flight / max(1, fleet_size) + IN_FLIGHT_SLACK


def choose(
    candidates: Sequence[Candidate], prompt_tokens: int, rule: DecisionRule, bound: float
) -> int:
    """Position in ``candidates`` of the one that takes the request (see module doc);
    ``bound`` is :func:`in_flight_bound`."""
    if rule.policy is SpillPolicyName.NONE:
        if candidates[0].cached_tokens > min(c.cached_tokens for c in candidates):
            return 0  # the deepest holder
        return min(range(len(candidates)), key=lambda i: candidates[i].backlog_s)
    least = max(0, prompt_tokens - max([c.cached_tokens for c in candidates]))
    backlogs = sorted([c.backlog_s for c in candidates])
    extra = rule.miss_weight_at(backlogs[len(backlogs) // 2]) - 1.0
    limit = rule.waiting_limit
    best, best_key, best_rank = 0, (0.0, 0), 3
    for i, (_, cached, backlog_s, waiting, in_flight, rate) in enumerate(candidates):
        # rank 0: allowed; 1: over the in-flight bound; 2: over the threshold too
        rank = 2 if waiting >= limit else 0 if in_flight < bound else 1
        own = prompt_tokens - cached if prompt_tokens > cached else 0
        key = (backlog_s + (own + extra * (own - least)) / rate, in_flight)
        if rank < best_rank or (rank == best_rank and key < best_key):
            best, best_key, best_rank = i, key, rank
    return best


def decide(
    key: PrefixKey,
    ring_order: Sequence[int],
    view: FleetView,
    rule: DecisionRule,
    tag_of: Sequence[int],
    instance_of: Mapping[int, int],
    overflow: Callable[[], Sequence[int]] = tuple,
    members: Sequence[int] | None = None,
) -> Decision:
    """Route one request (see the module doc). ``ring_order`` is the key's first ring
    instances (non-empty) and ``overflow`` lists more of them, asked for only when every
    candidate is overloaded; ``tag_of[i]`` is instance ``i``'s identity tag and
    ``instance_of`` the reverse, over the instances the request may go to.

    ``members``: the instances of the request's pool (:mod:`.pools`) when it is not the
    whole fleet; the in-flight bound is then the pool's mean, and holders outside it are
    not candidates (the caller's ``instance_of`` holds only the pool's tags)."""
    shift = 64 - rule.slots_log2
    located = [(block >> shift, block & 0xFFFF) for block in key.blocks]  # index.locate
    slots = [view.slot(slot) for slot, _ in located]
    models: dict[int, CacheModel | None] = {}

    def model_of(tag: int) -> CacheModel | None:
        if tag in models:
            return models[tag]
        model = models[tag] = view.cache_model(tag)
        return model

    held = match(slots, [fp for _, fp in located], model_of)
    cap = key.prompt_tokens - 1
    reach = key.held or key.ends
    common = max(0, min(reach[held.common - 1] // BYTES_PER_TOKEN, cap)) if held.common else 0
    cached: dict[int, int] = {}
    for tag, depth in sorted(held.depths.items(), key=_deepest_first):
        instance = instance_of.get(tag)
        tokens = max(0, min(reach[depth - 1] // BYTES_PER_TOKEN, cap))
        if instance is not None and tokens > common:  # holding what all hold is no claim
            cached[instance] = tokens
    deepest, home = next(iter(cached.values()), 0), next(iter(cached), None)
    for i in ring_order:
        cached.setdefault(i, common)
    candidates = [Candidate(i, tokens, *view.load(i)) for i, tokens in cached.items()]
    if members is None:
        bound = in_flight_bound(rule, view.total_in_flight(), len(tag_of))
    else:
        total = sum(view.load(i)[2] for i in members)
        bound = in_flight_bound(rule, total, len(members))
    limit = rule.waiting_limit
    if rule.policy is not SpillPolicyName.NONE and not any(
        [c.in_flight < bound and c.waiting < limit for c in candidates]
    ):
        candidates += [Candidate(i, common, *view.load(i)) for i in overflow() if i not in cached]
    chosen = candidates[choose(candidates, key.prompt_tokens, rule, bound)]
    if deepest <= common:
        outcome = Outcome.PLACED
    elif chosen.cached_tokens >= deepest:
        outcome = Outcome.HOME
    else:
        outcome = Outcome.SPILLED
    prefill = max(1, key.prompt_tokens - chosen.cached_tokens)
    return Decision(
        outcome=outcome,
        instance=chosen.instance,
        home=home if deepest > common else None,
        cached_tokens=chosen.cached_tokens,
        prefill_tokens=prefill,
        written_tokens=prefill + key.output_tokens,
        index_writes=_record_blocks(located, slots, tag_of[chosen.instance], model_of),
    )


def release_writes(
    blocks: Sequence[int], tag: int, view: FleetView, slots_log2: int
) -> tuple[EntryWrite, ...]:
    """The index writes a finished request makes: the instance with identity ``tag`` used
    ``blocks`` (the request's key's) until ``view.now``.

    vLLM frees a finished request's blocks to the back of its eviction queue, so what a
    request left in the cache is as recent as its end, not as its routing. An entry stamped
    only when the request was routed has aged by everything the instance wrote while the
    answer was generated (heavy-tailed answers take a minute), and a conversation's next
    turn found its holder forgotten and was placed as new: in the simulation, 314 of
    trace-like's 3,700 later turns, which found 7% of their prompt cached where they went;
    the token hit rate was 0.96 of the fleet-LRU bound, and 1.03 with these writes
    (bench/results/routing-defaults/notes.md). An entry is refreshed as
    :func:`.index.record` refreshes one (once a quarter stale: a short request writes
    nothing), or written again where it was replaced."""
    shift = 64 - slots_log2
    located = [(block >> shift, block & 0xFFFF) for block in blocks]  # index.locate
    slots = [view.slot(slot) for slot, _ in located]
    return _record_blocks(located, slots, tag, view.cache_model, force_last=False)


def _deepest_first(held: tuple[int, int]) -> int:
    return -held[1]


def _record_blocks(
    located: Sequence[tuple[int, int]],
    slots: Sequence[bytes],
    tag: int,
    model_of: ModelOf,
    *,
    force_last: bool = True,
) -> tuple[EntryWrite, ...]:
    """The index writes that record ``tag`` as holding every block of the request (the
    deepest one's entry refreshed whatever its age with ``force_last``)."""
    model = model_of(tag)
    if model is None:
        return ()
    writes: list[EntryWrite] = []
    latest: dict[int, bytes] = {}
    last = len(located) - 1
    for j, (slot, fp) in enumerate(located):
        current = latest.get(slot, slots[j])
        write = record(slot, current, fp, tag, model, model_of, force=force_last and j == last)
        if write is not None:
            writes.append(write)
            latest[slot] = apply(current, write)
    return tuple(writes)


__all__ = [
    "BYTES_PER_TOKEN",
    "Candidate",
    "Decision",
    "DecisionRule",
    "FleetView",
    "Outcome",
    "choose",
    "decide",
    "in_flight_bound",
    "release_writes",
]
