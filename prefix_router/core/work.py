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
prefill, ``num_gpu_blocks x block_size``), or the config's defaults until then.
``written_tokens`` grows by every token the instance writes to its KV cache (computed
prompt tokens and generated ones): the clock the prefix index (:mod:`.index`) uses to
forget what the instance has evicted.

Everything here is pure; the stores keep the numbers (in process, or in Redis for all
ext_proc replicas, where the same arithmetic runs inside the write so replicas add up).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import NamedTuple

MAX_WAITING_TRACKED = 256
"""Prefill ends kept per instance at most: more waiting requests read as this many. The
decision needs to know only whether ConcurrencyThreshold are waiting, so stores keep that
many (:func:`admit`'s ``keep``)."""


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """How fast an instance prefills and how much KV cache it has."""

    prefill_tokens_per_s: float
    kv_cache_tokens: float


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
    same engine steps each count those steps, so ``tokens / prefill_seconds`` alone is the
    rate divided by how many requests were in prefill at once (3x low at 60% load in the
    simulation). What the router needs is the rate while the instance prefills at all:
    ``tokens / busy``, with ``busy = tokens / rate`` its seconds of prefill. The mean
    number of requests in prefill is ``N = prefill_seconds / window_seconds``; served
    together (steps shared), that number is ``rho / (1 - rho)`` with ``rho`` the busy
    fraction, whatever the prompts' sizes (processor sharing), so
    ``rho = N / (1 + N)`` and::

        rate = throughput / rho = tokens / prefill_seconds + tokens / window_seconds

    It is exact for requests alone (``N`` small: the first term) and for a saturated
    instance (``rho`` near 1: the throughput); if requests never overlap it errs high
    by at most the factor ``1 + rho``, where the per-request sum would err low by the
    overlap instead.
    """
    if prefill_seconds < MIN_PREFILL_SECONDS or computed_tokens <= 0 or window_seconds <= 0:
        return None
    return computed_tokens / prefill_seconds + computed_tokens / window_seconds
