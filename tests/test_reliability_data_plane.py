"""Faults on the data path under load: no request fails, routing and counts recover.

Real Envoy, real ext_proc processes, simulated vLLM instances, and a Redis
server of the test's own (so it can be stopped and started again).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefix_router.core.config import RouterConfig
from tests.conftest import ProcessReaper
from tests.support.figures import report
from tests.support.own_redis import OwnRedis
from tests.support.static_stack import (
    StaticStack,
    envoy_stats,
    start_ext_proc_for,
    start_static_stack,
)
from tests.support.wait import async_wait_until, wait_until

pytestmark = pytest.mark.e2e

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
UNAVAILABLE = "routing store unavailable"  # ext_proc's log, once per outage
RESUMED = "fleet-wide routing resumed"


@pytest.fixture
def own_redis(procs: ProcessReaper, log_dir: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(procs, log_dir)
    server.start()
    yield server


def chat(prompt: str, max_tokens: int = 8) -> str:
    return json.dumps(
        {
            "model": MODEL,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}],
        }
    )


async def load(stack: StaticStack, seconds: float, concurrency: int = 12) -> Counter[int]:
    """Closed-loop load for ``seconds``: status codes seen (0 = transport error)."""
    return await load_until(stack, time.monotonic() + seconds, Counter(), concurrency)


async def load_until(
    stack: StaticStack,
    stop: float | asyncio.Event,
    codes: Counter[int],
    concurrency: int = 12,
    limit_s: float = 120.0,
) -> Counter[int]:
    """Closed-loop load until ``stop`` (a deadline or an event; at most ``limit_s``),
    counting status codes into ``codes`` as they come (0 = transport error)."""
    rng = random.Random(3)
    deadline = time.monotonic() + limit_s

    def going() -> bool:
        if time.monotonic() >= deadline:
            return False
        return not stop.is_set() if isinstance(stop, asyncio.Event) else time.monotonic() < stop

    async def worker(client: httpx.AsyncClient) -> None:
        while going():
            body = chat(f"prefix {rng.randrange(40)} " * 30)
            try:
                r = await client.post(f"{stack.url}/v1/chat/completions", content=body)
                codes[r.status_code] += 1
            except httpx.HTTPError:
                codes[0] += 1

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return codes


class Background:
    """:func:`load_until` in a task of this loop, until the ``async with`` block ends."""

    def __init__(self, stack: StaticStack, concurrency: int = 12) -> None:
        self.stack, self.concurrency = stack, concurrency
        self.codes: Counter[int] = Counter()
        self.stop = asyncio.Event()
        self.task: asyncio.Task[Counter[int]] | None = None

    async def __aenter__(self) -> Background:
        self.task = asyncio.create_task(
            load_until(self.stack, self.stop, self.codes, self.concurrency)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task

    def sent(self) -> int:
        return sum(self.codes.values())

    async def more(self, n: int, what: str) -> None:
        """Wait until ``n`` more requests got an answer (of any kind)."""
        target = self.sent() + n
        await async_wait_until(lambda: self.sent() >= target, 60, f"{n} requests {what}")


def sticky(stack: StaticStack, prompt: str, n: int = 5) -> bool:
    with httpx.Client(timeout=10) as client:
        seen = {
            client.post(f"{stack.url}/v1/chat/completions", content=chat(prompt, 1)).headers[
                "x-sim-instance"
            ]
            for _ in range(n)
        }
    return len(seen) == 1


def redis_stack(procs: ProcessReaper, log_dir: Path, own: OwnRedis) -> StaticStack:
    return start_static_stack(
        procs,
        log_dir,
        backends=4,
        ext_procs=1,
        config=RouterConfig(),
        sim_args=["--time-scale", "5"],
        ext_proc_args=["--redis-url", own.url],
    )


async def test_ext_proc_killed_mid_load_fails_no_request_and_recovers(
    procs: ProcessReaper, log_dir: Path, own_redis: OwnRedis
) -> None:
    stack = redis_stack(procs, log_dir, own_redis)
    async with Background(stack) as load:
        await load.more(50, "before the kill")
        stack.ext_procs[0].kill()
        await load.more(50, "while ext_proc is down")  # Envoy: failure_mode_allow
        restarted = procs.add(start_ext_proc_for(stack, stack.ext_proc_ports[0], log_dir))
        stack.ext_procs[0] = restarted
        resumed_after = await asyncio.to_thread(
            wait_until, lambda: sticky(stack, "sticky " * 50), 30, "routing by prefix resumed"
        )
        await load.more(50, "after the restart")
    codes = load.codes
    report(
        "ext_proc killed",
        sent=sum(codes.values()),
        failed=sum(codes.values()) - codes[200],
        routing_resumed_s=round(resumed_after, 3),
    )
    assert set(codes) == {200}, codes
    # The killed replica's counts go when its heartbeat expires and a janitor reaps them.
    await asyncio.to_thread(wait_until, lambda: own_redis.in_flight() == {}, 30, "counts reaped")


async def test_redis_stopped_and_restarted_mid_load_fails_no_request(
    procs: ProcessReaper, log_dir: Path, own_redis: OwnRedis
) -> None:
    stack = redis_stack(procs, log_dir, own_redis)
    log = log_dir / f"ext_proc-{stack.ext_proc_ports[0]}.log"
    async with Background(stack) as load:
        await load.more(50, "before the stop")
        own_redis.stop()
        await async_wait_until(lambda: UNAVAILABLE in log.read_text(), 30, "ext_proc sees it")
        await load.more(50, "while Redis is down")
        own_redis.start()
        await async_wait_until(lambda: RESUMED in log.read_text(), 30, "fleet-wide routing resumes")
        await load.more(50, "after the restart")
    codes = load.codes
    report("Redis stopped", sent=sum(codes.values()), failed=sum(codes.values()) - codes[200])
    assert set(codes) == {200}, codes
    # One outage, not one more per connection that was open to the stopped server.
    assert log.read_text().count(UNAVAILABLE) == 1, log.read_text()
    await counted_in(own_redis, stack)


async def counted_in(own_redis: OwnRedis, stack: StaticStack) -> None:
    """Fleet-wide routing works: a request is counted in Redis while in flight, and given back."""
    body = chat("after the outage " * 20, max_tokens=200)
    async with httpx.AsyncClient(timeout=30) as client:
        pending = asyncio.create_task(client.post(f"{stack.url}/v1/chat/completions", content=body))
        await asyncio.to_thread(wait_until, lambda: own_redis.in_flight() != {}, 30, "counted")
        assert (await pending).status_code == 200
    await asyncio.to_thread(wait_until, lambda: own_redis.in_flight() == {}, 30, "given back")


async def test_a_hung_redis_fails_no_request_and_every_decision_stays_bounded(
    procs: ProcessReaper, log_dir: Path, own_redis: OwnRedis
) -> None:
    """Redis frozen mid-load (SIGSTOP: connections stay open, nothing answers), then thawed.

    ext_proc's Redis round trip is bounded by ``redis_timeout_ms``: it decides on its own
    counts (``ring_only``) and answers every request itself, so Envoy never waits out its
    ext_proc ``message_timeout`` and no request goes on without a decision."""
    stack = redis_stack(procs, log_dir, own_redis)
    log = log_dir / f"ext_proc-{stack.ext_proc_ports[0]}.log"
    assert own_redis.proc is not None
    pid = own_redis.proc.pid
    async with Background(stack) as load:
        await load.more(50, "before the freeze")
        os.kill(pid, signal.SIGSTOP)
        try:
            await async_wait_until(lambda: UNAVAILABLE in log.read_text(), 30, "ext_proc sees it")
            await load.more(100, "while Redis hangs")
        finally:
            os.kill(pid, signal.SIGCONT)
        await async_wait_until(lambda: RESUMED in log.read_text(), 30, "fleet-wide routing resumes")
        await load.more(50, "after the thaw")
    codes = load.codes
    report("Redis hung", sent=sum(codes.values()), failed=sum(codes.values()) - codes[200])
    assert set(codes) == {200}, codes
    stats = envoy_stats(stack, "ext_proc")
    assert stats["http.data_plane.ext_proc.message_timeouts"] == 0, stats
    assert stats["http.data_plane.ext_proc.failure_mode_allowed"] == 0, stats
    assert log.read_text().count(UNAVAILABLE) == 1, log.read_text()
    await counted_in(own_redis, stack)


def envoy_health(stack: StaticStack) -> dict[str, bool]:
    """Envoy's view: ``ip:port`` -> passes active health checks."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{stack.admin_port}/clusters?format=json", timeout=5
    ) as r:
        clusters = json.load(r)["cluster_statuses"]
    out = {}
    for cluster in clusters:
        if cluster["name"] == "models":
            for h in cluster["host_statuses"]:
                sa = h["address"]["socket_address"]
                out[f"{sa['address']}:{sa['port_value']}"] = not h["health_status"].get(
                    "failed_active_health_check", False
                )
    return out


async def test_a_hung_instance_is_taken_out_by_health_checks(
    procs: ProcessReaper, log_dir: Path
) -> None:
    stack = start_static_stack(procs, log_dir, backends=4, sim_args=["--time-scale", "20"])
    victim = stack.fleet.instances[2].id
    async with httpx.AsyncClient(timeout=10) as client:
        health = envoy_health(stack)
        assert health and all(health.values())
        r = await client.post(f"http://{victim}/sim/fault", json={"mode": "hang"})
        assert r.status_code == 200
        try:
            hc = stack.config.health_check
            took = await asyncio.to_thread(
                wait_until, lambda: not envoy_health(stack)[victim], 30, "health checks take it out"
            )
            # unhealthy_threshold failed checks, each up to timeout, interval apart (+ jitter).
            bound = (hc.unhealthy_threshold * (hc.interval_ms + hc.timeout_ms)) / 1000 + 1.0
            codes = await load(stack, seconds=2)
            report(
                "instance hung",
                taken_out_s=round(took, 2),
                bound_s=bound,
                sent_after=sum(codes.values()),
                failed_after=sum(codes.values()) - codes[200],
            )
            assert set(codes) == {200}, codes
        finally:
            await client.post(f"http://{victim}/sim/fault", json={"mode": "none"})


async def test_when_every_health_check_fails_at_once_requests_still_go_through(
    procs: ProcessReaper, log_dir: Path
) -> None:
    """Every check failing at once is likelier the checker's side than every instance:
    Envoy routes over all instances then, rather than answering each request 503."""
    config = RouterConfig.model_validate(
        {"health_check": {"interval_ms": 200, "timeout_ms": 100, "unhealthy_threshold": 2}}
    )
    stack = start_static_stack(
        procs, log_dir, backends=3, config=config, sim_args=["--time-scale", "20"]
    )
    slow = {"mode": "slow", "extra_latency_ms": 300}  # /health slower than its timeout
    async with httpx.AsyncClient(timeout=10) as client:
        for instance in stack.fleet.instances:
            assert (await client.post(f"http://{instance.id}/sim/fault", json=slow)).is_success
        try:

            def every_check_fails() -> bool:
                health = envoy_health(stack)
                return bool(health) and not any(health.values())

            await asyncio.to_thread(wait_until, every_check_fails, 30, "every check fails")
            codes = await load(stack, seconds=2, concurrency=6)
            report("every health check failing", sent=sum(codes.values()), codes=dict(codes))
            assert set(codes) == {200}, codes
        finally:
            for instance in stack.fleet.instances:
                await client.post(f"http://{instance.id}/sim/fault", json={"mode": "none"})
