"""Open-loop load driver: send a workload on its schedule, stream, time every request.

Open loop: a request is sent at its arrival time whatever happened to earlier ones, so a
slow fleet sees its queue grow rather than its load fall (conversations are the exception
a chat client makes: a turn goes ``think_s`` after the previous answer, which it resends).
Each request streams (SSE); TTFT is taken at the first event that carries content, the
end-to-end latency at the end of the stream. A request that fails (connection error,
non-200 status, an error event, the per-request timeout, the end of the run) is recorded
with the reason; the run never raises for a failed request.

Time. ``time_scale`` model seconds pass per wall second: arrivals are sent at
``arrival_s / time_scale`` wall seconds and wall latencies are multiplied by it, so a
simulator running ``--time-scale X`` is driven and measured in its simulated seconds
(the client-side overheads, Envoy's and ext_proc's included, are scaled up by X too).

The run is bounded: at most the workload's requests, at most ``max_in_flight`` at once
(more are failed at once as ``overload``), and ``max_duration_s`` of wall time, after
which whatever is still in flight is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import orjson

from bench.results import RequestRecord
from bench.spec import PATHS, Arrival, Message, Turn, Workload, request_body


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverSettings:
    base_url: str
    model: str
    time_scale: float = 1.0
    request_timeout_s: float = 600.0
    """Seconds one request may take, on the instances' clock: a simulated fleet at time
    scale s gets ``request_timeout_s / s`` wall seconds (:attr:`request_deadline_s`), so
    a slowed-down run times out the same requests as one at full speed."""
    max_duration_s: float = 3600.0
    """Wall seconds the whole run may take."""
    max_in_flight: int = 2048
    instance_header: str = "x-sim-instance"
    """Response header naming the instance that served (the simulator sets it)."""

    @property
    def request_deadline_s(self) -> float:
        """Wall seconds one request may take (never past the run's own bound)."""
        return min(self.request_timeout_s / self.time_scale, self.max_duration_s)


@dataclass(slots=True)
class Sent:
    """What the bounds need of one request: its body and what came back."""

    endpoint: str
    body: bytes
    output: str = ""


@dataclass(slots=True)
class DriveOutcome:
    records: list[RequestRecord]
    sent: list[Sent]
    """Index-aligned with ``records``."""
    peaks: dict[str, int]
    """Client-side peak in flight per instance (from the instance header)."""
    counts: dict[str, int]
    wall_s: float
    duration_s: float
    """Model seconds from the first send to the last completion."""


@dataclass
class _Run:
    settings: DriverSettings
    client: httpx.AsyncClient
    on_done: Callable[[RequestRecord], None] | None
    start: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    active: int = 0
    last_end: float = 0.0

    def model_time(self, wall: float) -> float:
        return (wall - self.start) * self.settings.time_scale

    async def conversation(self, arrival: Arrival) -> None:
        history: tuple[Message, ...] = ()
        for index, turn in enumerate(arrival.turns):
            if index:
                await asyncio.sleep(turn.think_s / self.settings.time_scale)
            answer = await self.request(turn, history)
            if answer is None:
                return  # the conversation cannot go on without its answer
            history = (*history, *turn.messages, ("assistant", answer))

    async def request(self, turn: Turn, history: tuple[Message, ...]) -> str | None:
        s = self.settings
        body = request_body(turn, model=s.model, history=history)
        sent_at = time.perf_counter()
        record = RequestRecord(
            arrival_s=self.model_time(sent_at), instance=None, ttft_s=None, e2e_s=None
        )
        sent = Sent(turn.endpoint, body)
        self.records.append(record)
        self.sent.append(sent)
        if self.active >= s.max_in_flight:
            record.error = "overload"
            self._done(record)
            return None
        self.active += 1
        try:
            async with asyncio.timeout(s.request_deadline_s):
                await self._stream(PATHS[turn.endpoint], body, sent_at, record, sent)
        except TimeoutError:
            record.error = "timeout"
        except asyncio.CancelledError:
            record.error = "cancelled (end of run)"
            raise
        except httpx.HTTPError as exc:
            record.error = type(exc).__name__
        finally:
            self.active -= 1
            self._done(record)
        return sent.output if record.error is None else None

    async def _stream(
        self, path: str, body: bytes, sent_at: float, record: RequestRecord, sent: Sent
    ) -> None:
        headers = {"content-type": "application/json"}
        scale = self.settings.time_scale
        async with self.client.stream("POST", path, content=body, headers=headers) as response:
            instance = response.headers.get(self.settings.instance_header)
            record.instance = instance
            if instance is not None:
                count = self.in_flight.get(instance, 0) + 1
                self.in_flight[instance] = count
                self.peaks[instance] = max(self.peaks.get(instance, 0), count)
                self.counts[instance] = self.counts.get(instance, 0) + 1
            try:
                if response.status_code != 200:
                    await response.aread()
                    record.error = f"HTTP {response.status_code}"
                    return
                pieces: list[str] = []
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = orjson.loads(line[6:])
                    if "error" in event:
                        record.error = f"error event: {event['error'].get('message', '')[:80]}"
                        return
                    for choice in event.get("choices") or ():
                        text = choice.get("text")
                        if text is None:
                            text = (choice.get("delta") or {}).get("content")
                        if text:
                            if record.ttft_s is None:
                                record.ttft_s = (time.perf_counter() - sent_at) * scale
                            pieces.append(text)
                    usage = event.get("usage")
                    if usage:
                        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        record.output_tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            record.cached_tokens = int(details["cached_tokens"])
                end = time.perf_counter()
                record.e2e_s = (end - sent_at) * scale
                self.last_end = max(self.last_end, end)
                sent.output = "".join(pieces)
                if record.ttft_s is None:
                    record.error = "no content"
            finally:
                if instance is not None:
                    self.in_flight[instance] -= 1

    def _done(self, record: RequestRecord) -> None:
        if self.on_done is not None:
            self.on_done(record)


async def _warm_up(client: httpx.AsyncClient) -> None:
    """One request that touches no cache, so connection set-up is not in the first TTFT."""
    with contextlib.suppress(httpx.HTTPError):
        await client.get("/v1/models")


async def drive(
    workload: Workload,
    settings: DriverSettings,
    *,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> DriveOutcome:
    """Send ``workload`` to ``settings.base_url`` on its schedule; every request is recorded."""
    limits = httpx.Limits(
        max_connections=settings.max_in_flight + 16, max_keepalive_connections=256
    )
    async with httpx.AsyncClient(
        base_url=settings.base_url, limits=limits, timeout=httpx.Timeout(None, connect=10.0)
    ) as client:
        run = _Run(settings, client, on_done)
        loop = asyncio.get_running_loop()
        await _warm_up(client)
        arrivals = iter(workload)
        upcoming = next(arrivals, None)  # built before the clock starts
        run.start = time.perf_counter()
        deadline = loop.time() + settings.max_duration_s
        tasks: set[asyncio.Task[None]] = set()
        try:
            async with asyncio.timeout_at(deadline):
                for arrival in itertools.chain([upcoming] if upcoming else [], arrivals):
                    delay = run.start + arrival.arrival_s / settings.time_scale
                    delay -= time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    task = loop.create_task(run.conversation(arrival))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.wait(set(tasks))
        except TimeoutError:
            pass
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - run.start
        first = min((r.arrival_s for r in run.records), default=0.0)
        last = run.model_time(run.last_end) if run.last_end else first
        return DriveOutcome(
            records=run.records,
            sent=run.sent,
            peaks=dict(run.peaks),
            counts=dict(run.counts),
            wall_s=wall,
            duration_s=max(0.0, last - first),
        )
