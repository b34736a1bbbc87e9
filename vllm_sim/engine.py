"""The asyncio shell around the pure scheduler: one sleeping step task per instance.

The step task wakes when work arrives, asks the scheduler for a step, prices it with the
cost model, sleeps ``step / time_scale`` of wall-clock time, then applies the step and wakes
the consumers of the sequences that got a token. It never spins and does bookkeeping only,
so many engines share one process and one event loop.

Simulated clock. Latencies are reported in simulated seconds, independent of ``time_scale``
and of Python's overhead: simulated time advances only while a step runs, from the step's
start at ``time_scale`` times wall speed but never past its end, and a step always ends
exactly ``step`` seconds after it began. Between steps and while idle it stands still, so a
request that finds the engine idle starts its first step at its own arrival time, and one
that arrives mid-step waits for the rest of that step. TTFT is therefore queueing plus the
steps that prefill it, whatever the host's speed or the time scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from vllm_sim.config import EngineConfig
from vllm_sim.errors import BadRequestError, EngineStoppedError
from vllm_sim.prefix_cache import hash_blocks, hash_seed
from vllm_sim.scheduler import Scheduler, SeqStatus, Sequence, new_sequence
from vllm_sim.stats import EngineStats
from vllm_sim.tokenizer import generate_output


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What the engine needs from a request, after the API layer validated it."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    model: str = ""
    cache_salt: str | None = None
    seed: int | None = None


def build_sequence(
    config: EngineConfig, params: GenerationParams, *, request_id: str, arrival_time: float
) -> Sequence:
    """The engine's view of one request: checked, its output decided, its blocks hashed.

    Pure, so the discrete-event simulation (``bench.des``) builds requests
    exactly as :meth:`Engine.submit` does. Raises :class:`BadRequestError` if the request
    can never fit the context.
    """
    prompt = params.prompt
    limit = config.effective_max_model_len
    if not prompt:
        raise BadRequestError("the prompt is empty", param="prompt")
    if len(prompt) + params.max_tokens > limit:
        raise BadRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the messages, "
            f"{params.max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="max_tokens",
        )
    seed = zlib.crc32(array("Q", prompt).tobytes(), params.seed or 0) ^ params.max_tokens
    n_out = params.max_tokens if params.ignore_eos else 1 + (seed >> 3) % params.max_tokens
    output = generate_output(seed, n_out)
    hashes = hash_blocks(
        prompt + output,
        block_size=config.block_size,
        seed=hash_seed(params.model or config.model, params.cache_salt),
    )
    return new_sequence(
        request_id=request_id,
        prompt=prompt,
        output=output,
        finish_reason="length" if n_out == params.max_tokens else "stop",
        arrival_time=arrival_time,
        hashes=hashes,
    )


class RequestHandle:
    """Consumer side of one request: progress, completion and a way to wait for either."""

    __slots__ = ("seq", "_waiter", "_wake_on_done_only")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self._waiter: asyncio.Future[None] | None = None
        self._wake_on_done_only = False

    @property
    def num_output(self) -> int:
        return self.seq.num_output

    @property
    def done(self) -> bool:
        return self.seq.status in (SeqStatus.FINISHED, SeqStatus.ABORTED)

    @property
    def aborted(self) -> bool:
        return self.seq.status is SeqStatus.ABORTED

    @property
    def output_ids(self) -> list[int]:
        """Tokens generated so far."""
        seq = self.seq
        return seq.tokens[seq.prompt_len : seq.prompt_len + seq.num_output]

    async def wait(self, seen: int) -> None:
        """Return once more than ``seen`` tokens exist or the request is done."""
        while self.seq.num_output <= seen and not self.done:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def wait_done(self) -> None:
        """Return once the request finished or was aborted (woken once, not per token)."""
        self._wake_on_done_only = True
        while not self.done:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def notify(self) -> None:
        """Called by the engine on progress; wakes the consumer if it waits for this."""
        waiter = self._waiter
        if waiter is None or (self._wake_on_done_only and not self.done):
            return
        self._waiter = None
        if not waiter.done():
            waiter.set_result(None)


class Engine:
    """One simulated vLLM engine; :meth:`start` it inside a running event loop."""

    def __init__(
        self, config: EngineConfig, *, wall_clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.stats = EngineStats()
        self.scheduler = Scheduler(config, self.stats)
        self._wall = wall_clock
        self._sim_anchor = 0.0
        self._wall_anchor = wall_clock()
        self._sim_cap = 0.0
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.steps = 0

    # -- clock ----------------------------------------------------------------------------

    def now(self) -> float:
        """Simulated seconds of work since the engine was created (see module docstring)."""
        elapsed = (self._wall() - self._wall_anchor) * self.config.time_scale
        return self._sim_anchor + min(elapsed, self._sim_cap)

    def _anchor(self, sim: float, cap: float) -> None:
        self._sim_anchor, self._wall_anchor, self._sim_cap = sim, self._wall(), cap

    # -- requests -------------------------------------------------------------------------

    def submit(self, params: GenerationParams, *, request_id: str | None = None) -> RequestHandle:
        """Queue a request; raises :class:`BadRequestError` if it can never fit the context."""
        config = self.config
        if self._closed:
            raise EngineStoppedError("the engine is stopped")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        while rid in self._handles:
            rid = f"{rid}-{next(self._ids)}"
        seq = build_sequence(config, params, request_id=rid, arrival_time=self.now())
        handle = RequestHandle(seq)
        self._handles[rid] = handle
        self.scheduler.add(seq)
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Drop a request (client gone); its blocks are released at once."""
        if self.scheduler.abort(handle.seq):
            self._handles.pop(handle.seq.request_id, None)
            handle.notify()
            self._wake.set()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-sim-step")

    async def stop(self) -> None:
        """Abort every request and end the step task."""
        self._closed = True
        for handle in list(self._handles.values()):
            self.abort(handle)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def pause(self) -> None:
        """Freeze the engine (the ``hang`` fault): no step runs until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def _run(self) -> None:
        scheduler, cost, scale = self.scheduler, self.config.cost, self.config.time_scale
        while not self._closed:
            if not self._running.is_set():
                await self._running.wait()
                continue
            if not scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            start = self.now()
            plan = scheduler.schedule(start)
            if plan.empty:
                if plan.preempted:
                    continue  # the preempted wait at the queue's head: admit them now
                self._wake.clear()  # nothing fits until something changes
                await self._wake.wait()
                continue
            duration = cost.step_seconds(
                prefill_tokens=plan.prefill_tokens,
                decode_seqs=plan.decode_seqs,
                context_tokens=plan.context_tokens,
            )
            self._anchor(start, duration)
            wall_end = self._wall_anchor + duration / scale
            await asyncio.sleep(max(0.0, wall_end - self._wall()))
            end = start + duration
            self._anchor(end, 0.0)
            outcome = scheduler.complete(plan, end)
            self.steps += 1
            handles = self._handles
            for seq in outcome.progressed:
                handle = handles.get(seq.request_id)
                if handle is not None:
                    handle.notify()
            for seq in outcome.finished:
                handles.pop(seq.request_id, None)
