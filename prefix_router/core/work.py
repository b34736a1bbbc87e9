"""Load measured in work: each instance's queue of prefill, as the router has filled it.

What makes time to first token grow is prefill waiting or running on the instance, not
requests that are only decoding. So each instance is modelled as a first-come first-served
server of prefill work: a request routed to it at ``now`` brings the tokens it must compute
(its prompt minus what the instance caches), which start when the instance's earlier
prefill is done and take ``tokens / prefill_tokens_per_s``::

    start = max(now, busy_until)        end = start + tokens / rate        busy_until = end

``busy_until - now`` is the instance's backlog in seconds (its queueing delay for prefill),
and the requests whose ``end`` lies ahead are those still waiting for their first token:
the count ConcurrencyThreshold bounds. Decoding requests count in neither.

The rate and the cache size are the instance's own (:class:`InstanceModel`): learned by the
control plane from the instance's vLLM metrics (prompt tokens computed per second of
prefill, ``num_gpu_blocks x block_size``), or the config's defaults until then. So is the
waiting count the instance itself reports, which can only raise the router's.
``written_tokens`` grows by every token the instance writes to its KV cache (computed
prompt tokens and generated ones): the clock the prefix index (:mod:`.index`) uses to
forget what the instance has evicted.

Everything here is pure; the stores keep the numbers (in process, or in Redis for all
ext_proc replicas, where the same arithmetic runs inside the write so replicas add up).
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_right
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

Load = tuple[float, int, int, float]
"""One instance's load as a decision weighs it: ``(backlog_s, waiting, in_flight,
prefill_tokens_per_s)``: its queued prefill in seconds, the requests waiting for their
first token, the requests in flight, and its prefill rate."""

MAX_WAITING_TRACKED = 256
"""Prefill ends kept per instance when ConcurrencyThreshold is off (the default): more
waiting requests read as this many (the fleet view shows them). With a threshold set, the
decision needs to know only whether that many are waiting, so stores keep that many
(:func:`admit`'s ``keep``, ``DecisionRule.waiting_kept``)."""


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """How fast an instance prefills, how much KV cache it has, and how many requests it
    last said were waiting."""

    prefill_tokens_per_s: float
    kv_cache_tokens: float
    waiting: int = 0
    """``vllm:num_requests_waiting`` at the instance's latest scrape (0: unknown or stale).
    It sees what the router's own count cannot: traffic that reached the instance by another
    path, or prefill slower than modelled. Stale by up to a scrape interval, so it only
    ever raises the count ConcurrencyThreshold compares (:meth:`InstanceWork.waiting` is
    exact for what happens between scrapes)."""

    def waiting_with(self, work: InstanceWork, now: float) -> int:
        """Requests waiting for their first token: the router's count, or the instance's
        own if it says more."""
        return max(work.waiting(now), self.waiting)

    def load(self, work: InstanceWork, now: float, in_flight: int) -> Load:
        """The instance's :data:`Load` at ``now`` with ``work`` queued and ``in_flight``
        requests (what both stores' views give a decision for each candidate)."""
        return (
            work.backlog_s(now),
            self.waiting_with(work, now),
            in_flight,
            self.prefill_tokens_per_s,
        )


MEASURED_WAITING_MAX_AGE_S = 10.0
"""A scraped waiting count older than this is ignored: the control plane scrapes every 2 s
by default, so a count this old means its scrapes (or the control plane) stopped."""


def model_text(model: InstanceModel, observed_at: float | None) -> str:
    """``model`` as the control plane publishes it in Redis for every ext_proc replica:
    ``rate capacity`` (0 where unknown), plus ``waiting observed_at`` (wall-clock seconds)
    when the instance's latest scrape succeeded."""
    text = f"{model.prefill_tokens_per_s:.0f} {model.kv_cache_tokens:.0f}"
    if observed_at is None:
        return text
    return f"{text} {model.waiting} {observed_at:.3f}"


def model_of_text(raw: bytes | str, now: float) -> InstanceModel:
    """What :func:`model_text` wrote, as of wall-clock ``now``: 0 for what is unknown or
    unreadable, and no waiting count once it is older than
    :data:`MEASURED_WAITING_MAX_AGE_S` (or written in the future: another clock)."""
    fields = (raw.decode() if isinstance(raw, bytes) else raw).split()
    try:
        rate, capacity = (max(0.0, float(x)) for x in fields[:2])
    except ValueError:
        return InstanceModel(0.0, 0.0)
    if not (math.isfinite(rate) and math.isfinite(capacity)):
        return InstanceModel(0.0, 0.0)
    waiting = 0
    if len(fields) == 4:
        try:
            count, at = int(fields[2]), float(fields[3])
        except ValueError:
            count, at = 0, math.nan
        if 0 <= now - at <= MEASURED_WAITING_MAX_AGE_S:
            waiting = max(0, count)
    return InstanceModel(prefill_tokens_per_s=rate, kv_cache_tokens=capacity, waiting=waiting)


class InstanceWork(NamedTuple):
    """One instance's modelled prefill queue and cache clock."""

    busy_until: float = 0.0
    """When the prefill routed to it so far is done (seconds on the router's clock)."""
    ends: tuple[float, ...] = ()
    """Prefill end of each request routed to it, in order (those still ahead matter)."""
    written_tokens: float = 0.0
    """Tokens written to its KV cache so far (the prefix index's clock)."""

    def backlog_s(self, now: float) -> float:
        """Seconds a request routed now would wait for the prefill before it."""
        return max(0.0, self.busy_until - now)

    def waiting(self, now: float) -> int:
        """Requests estimated to be waiting for (or computing) their first token."""
        return len(self.ends) - bisect_right(self.ends, now)


def admit(
    work: InstanceWork,
    now: float,
    *,
    prefill_tokens: float,
    written_tokens: float,
    rate: float,
    keep: int = MAX_WAITING_TRACKED,
) -> InstanceWork:
    """``work`` after a request is routed to it at ``now``: ``prefill_tokens`` to compute,
    ``written_tokens`` (prefill plus expected output) to write to its cache. The last
    ``keep`` prefill ends are kept (waiting counts read up to ``keep``)."""
    end = max(now, work.busy_until) + prefill_tokens / rate
    ends = work.ends
    if ends and ends[0] <= now or len(ends) >= keep:
        ends = ends[bisect_right(ends, now) :]
        ends = ends[len(ends) - keep + 1 :] if keep > 1 else ()
    return InstanceWork(end, (*ends, end), work.written_tokens + written_tokens)


def finished(work: InstanceWork, now: float, end: float) -> InstanceWork:
    """``work`` after a request whose prefill was modelled to end at ``end`` finished at
    ``now``: it had its first token, so the prefill queued up to ``end`` is done, whatever
    the model said. An instance faster than its modelled rate (a rate not yet learned, or
    a backend that is not vLLM) thus never looks busier than the requests still in flight
    on it make it; when the model is right, ``end`` has passed and nothing changes."""
    if end <= now:
        return work
    early = end - now  # the queue behind the request moves up by as much
    ahead = tuple(e - early for e in work.ends[bisect_right(work.ends, end) :])
    return InstanceWork(max(now, work.busy_until - early), ahead, work.written_tokens)


MIN_PREFILL_SECONDS = 1.0
"""Prefill time a window of metrics must hold before a rate is learned from it."""


def learned_prefill_rate(
    computed_tokens: float, prefill_seconds: float, window_seconds: float
) -> float | None:
    """An instance's prefill rate from its metrics over a window of ``window_seconds``:
    prompt tokens computed (``vllm:prefix_cache_queries`` minus ``hits``) per second the
    instance spent prefilling. None when the window holds too little prefill to tell.

    vLLM's ``vllm:request_prefill_time_seconds`` is per request: requests prefilled in the
    same engine steps each count those steps. With ``N = prefill_seconds /
    window_seconds`` the mean number of requests in prefill, the true rate lies between
    two bounds the metrics cannot tell apart:

    * requests never overlap (each prefills alone, first come first served):
      ``tokens / prefill_seconds``;
    * requests always share their steps (processor sharing: ``N = rho / (1 - rho)`` with
      ``rho`` the busy fraction): ``tokens / prefill_seconds * (1 + N)``.

    vLLM's scheduler is in between (waiting requests join the next step together, up to
    its token budget; a long prompt's chunks go first come first served), and how far
    depends on the traffic. The estimate is the geometric mean of the two bounds,
    ``tokens / prefill_seconds * sqrt(1 + N)``, which errs by at most ``sqrt(1 + N)``
    either way, where either bound alone may err by ``1 + N`` (the lower one read chat
    traffic 3x low; the upper one unique prompts 1.5x high, and a rate read high makes
    queues look drained before they are: in the simulation, P99 TTFT on unique prompts
    went from 985 ms to 822 ms, round robin's being 896 ms, and to 741 ms with the true
    rate).
    """
    if prefill_seconds < MIN_PREFILL_SECONDS or computed_tokens <= 0 or window_seconds <= 0:
        return None
    return computed_tokens / prefill_seconds * math.sqrt(1.0 + prefill_seconds / window_seconds)


def rates_by_group(
    learned: Mapping[str, float | None], group_of: Mapping[str, Hashable]
) -> dict[str, float]:
    """The prefill rate the router uses for each instance of ``learned`` (instance ->
    its own :func:`learned_prefill_rate`, None where the window could not tell): the
    median of the rates learned in its group (``group_of``: instances alike in speed,
    e.g. those serving the same models), else the median of every learned rate, else 0
    (unknown: the config's default applies).

    A median, not the instance's own rate: an instance that mostly serves cached prompts
    prefills a few tokens a step and would pass for a slow one, which would push its
    cached traffic away. By group, because a fleet serving a 70B and an 8B model has
    two speeds, several times apart, and one median would make one pool's queues look
    longer than they are and the other's shorter. An instance missing from ``group_of``
    is a group of its own."""
    known = {i: r for i, r in learned.items() if r}
    groups: dict[Hashable, list[float]] = {}
    for instance, rate in known.items():
        groups.setdefault(group_of.get(instance, ("instance", instance)), []).append(rate)
    fleet = statistics.median(known.values()) if known else 0.0
    out = {}
    for instance in learned:
        group = groups.get(group_of.get(instance, ("instance", instance)))
        out[instance] = statistics.median(group) if group else fleet
    return out
