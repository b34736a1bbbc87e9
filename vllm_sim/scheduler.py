"""Continuous-batching scheduler with chunked prefill and preemption, as vLLM's v1 does it.

Pure and synchronous: the caller passes simulated time in and sleeps for the step itself.

One step (:meth:`Scheduler.schedule`), with a token budget of ``max_num_batched_tokens``:

1. Running sequences first, in admission order: each asks for its remaining prompt chunk
   (chunked prefill) or one decode token. If the KV pool cannot grow it, the *newest*
   running sequence is preempted by recompute (blocks released, progress forgotten, put
   back at the front of the waiting queue) until it fits or itself was preempted.
2. Then, unless something was preempted, waiting sequences FCFS while the budget lasts and
   fewer than ``max_num_seqs`` run: on first admission the prefix cache is looked up, and
   only the uncached tokens are scheduled. A sequence that cannot get blocks waits (the
   queue is FCFS: nobody overtakes it).

:meth:`Scheduler.complete` then applies the step at its end time: computed tokens advance,
full blocks are registered in the prefix cache (decode blocks included), a sequence whose
every known token is computed samples one token, and finished sequences release their
blocks. Latency histograms and token counters are recorded here, in simulated seconds.

Cost per step: O(scheduled sequences + newly computed blocks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from enum import Enum

from vllm_sim.config import EngineConfig
from vllm_sim.prefix_cache import BlockHash, BlockTable, PrefixCache
from vllm_sim.stats import EngineStats


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine.

    ``tokens`` holds the prompt followed by every token the request will generate (the
    simulator decides the output up front); ``num_output`` of them have been generated so
    far. ``hashes`` are the chained hashes of the full blocks of ``tokens``.
    """

    request_id: str
    prompt_len: int
    tokens: list[int]
    hashes: list[BlockHash]
    finish_reason: str
    arrival_time: float
    num_output: int = 0
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    cached_tokens: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def max_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt plus the tokens generated."""
        return self.prompt_len + self.num_output


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes: ``(sequence, new tokens)`` pairs and the cost model's inputs."""

    work: tuple[tuple[Sequence, int], ...]
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    preempted: tuple[Sequence, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.work


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """Sequences that got a new token in the step, and those among them that finished."""

    progressed: tuple[Sequence, ...]
    finished: tuple[Sequence, ...]


class Scheduler:
    """Waiting queue, running batch and KV pool of one engine (see module docstring)."""

    def __init__(self, config: EngineConfig, stats: EngineStats | None = None) -> None:
        self.config = config
        self.cache = PrefixCache(
            num_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            enable_caching=config.enable_prefix_caching,
        )
        self.stats = stats if stats is not None else EngineStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.peak_in_flight = 0
        """The most requests held at once (waiting + running): benchmarks check a routing
        policy's concurrency bound against what the instance saw, not a client's view."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (FCFS)."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self.peak_in_flight = max(self.peak_in_flight, len(self.waiting) + len(self.running))

    def abort(self, seq: Sequence) -> bool:
        """Drop ``seq`` wherever it is; safe mid-step (``complete`` skips it). True if dropped."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.cache.release(seq.table)
        else:
            return False
        seq.status = SeqStatus.ABORTED
        self.stats.count_finished("abort")
        return True

    def schedule(self, now: float) -> StepPlan:
        """Choose the next step's work (mutates queues and block tables, not progress)."""
        budget = self.config.max_num_batched_tokens
        cache = self.cache
        work: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not cache.allocate(seq.table, seq.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            work.append((seq, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(now, budget, work)
        return self._plan(work, preempted)

    def _admit(self, now: float, budget: int, work: list[tuple[Sequence, int]]) -> int:
        cache, stats = self.cache, self.stats
        block_size = cache.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = cache.lookup(seq.hashes, seq.num_tokens)
            num_cached = len(hits) * block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not cache.allocate(seq.table, num_cached + n, hits):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.num_computed = num_cached
            self.running.append(seq)
            work.append((seq, n))
            budget -= n
            if seq.cached_tokens is None:  # first admission; a recompute is not a new query
                seq.cached_tokens = num_cached
                seq.first_scheduled_time = now
                stats.prefix_cache_queries += seq.num_tokens
                stats.prefix_cache_hits += num_cached
                stats.queue_time.observe(now - seq.arrival_time)
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.cache.release(seq.table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    @staticmethod
    def _plan(work: list[tuple[Sequence, int]], preempted: list[Sequence]) -> StepPlan:
        prefill = decode = context = 0
        for seq, n in work:
            if n == 1 and seq.num_computed >= seq.prompt_len:
                decode += 1
            else:
                prefill += n
            context += seq.num_computed + n
        return StepPlan(tuple(work), prefill, decode, context, tuple(preempted))

    def complete(self, plan: StepPlan, now: float) -> StepOutcome:
        """Apply ``plan`` as finished at simulated time ``now``."""
        cache, stats = self.cache, self.stats
        progressed: list[Sequence] = []
        finished: list[Sequence] = []
        for seq, n in plan.work:
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted during the step
            seq.num_computed += n
            cache.register(seq.table, seq.hashes, seq.num_computed)
            if seq.num_computed < seq.num_tokens:
                continue  # prompt chunk, more to come
            seq.num_output += 1
            stats.generation_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                stats.prompt_tokens += seq.prompt_len
                stats.ttft.observe(now - seq.arrival_time)
                stats.prefill_time.observe(now - (seq.first_scheduled_time or now))
            elif seq.last_token_time is not None:
                stats.itl.observe(now - seq.last_token_time)
            seq.last_token_time = now
            progressed.append(seq)
            if seq.num_output >= seq.max_output:
                seq.status = SeqStatus.FINISHED
                seq.finish_time = now
                cache.release(seq.table)
                stats.count_finished(seq.finish_reason)
                stats.e2e.observe(now - seq.arrival_time)
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return StepOutcome(tuple(progressed), tuple(finished))

    def snapshot(self) -> dict[str, int | float]:
        """Live counts for ``/sim/state`` and the gauges."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "peak_in_flight": self.peak_in_flight,
            "kv_cache_usage": self.cache.usage,
            "num_free_blocks": self.cache.num_free,
            "num_cached_blocks": self.cache.num_cached_blocks,
        }


def new_sequence(
    *,
    request_id: str,
    prompt: SequenceABC[int],
    output: SequenceABC[int],
    finish_reason: str,
    arrival_time: float,
    hashes: list[BlockHash],
) -> Sequence:
    """A waiting sequence whose ``tokens`` are ``prompt + output``."""
    return Sequence(
        request_id=request_id,
        prompt_len=len(prompt),
        tokens=[*prompt, *output],
        hashes=hashes,
        finish_reason=finish_reason,
        arrival_time=arrival_time,
    )
