"""Overload spill through real Envoy, two ext_proc replicas sharing counts in real Redis,
and slow simulated vLLM instances."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from prefix_router.core.config import RouterConfig
from prefix_router.core.key import extract_key
from prefix_router.core.table import RoutingTable
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.static_stack import StaticStack, start_static_stack

pytestmark = pytest.mark.e2e

THRESHOLD = 16
INSTANCES = 8
MODEL = "meta-llama/Llama-3.1-70B-Instruct"
# ~60 decode steps of ~20 ms simulated at time scale 1: each request stays in flight ~1.5 s.
SIM_ARGS = ["--time-scale", "1"]
HOT_PROMPT = "You are the hot system prompt everyone shares. " * 20


def spill_stack(
    procs: ProcessReaper, log_dir: Path, namespace: str, policy: str = "bounded-load"
) -> StaticStack:
    config = RouterConfig.model_validate(
        {"concurrency_threshold": THRESHOLD, "spill": {"policy": policy}}
    )
    return start_static_stack(
        procs,
        log_dir,
        backends=INSTANCES,
        ext_procs=2,
        config=config,
        sim_args=SIM_ARGS,
        ext_proc_args=["--redis-url", REDIS_URL, "--namespace", namespace],
    )


class PeakSampler:
    """Samples every instance's running + waiting requests until stopped; keeps the peak."""

    def __init__(self, stack: StaticStack) -> None:
        self.urls = [f"http://{i.id}/sim/state" for i in stack.fleet.instances]
        self.peak: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    async def _run(self, client: httpx.AsyncClient) -> None:
        while True:
            states = await asyncio.gather(*(client.get(u) for u in self.urls))
            for state in states:
                body = state.json()
                load = body["running"] + body["waiting"]
                self.peak[body["name"]] = max(self.peak[body["name"]], load)
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> PeakSampler:
        self._client = httpx.AsyncClient(timeout=5)
        self._task = asyncio.create_task(self._run(self._client))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()


def chat_body(prompt: str) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}],
            "max_tokens": 60,
            "ignore_eos": True,
        }
    ).encode()


async def burst(stack: StaticStack, n: int, prompt: str = HOT_PROMPT) -> Counter[str]:
    """``n`` concurrent requests with one prefix; which instance served each."""
    body = chat_body(prompt)
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        answers = await asyncio.gather(
            *(client.post(f"{stack.url}/v1/chat/completions", content=body) for _ in range(n))
        )
    assert [a.status_code for a in answers] == [200] * n
    return Counter(a.headers["x-sim-instance"] for a in answers)


def uncounted_routing_stats(stack: StaticStack) -> dict[str, str]:
    """Envoy counters that mean a request went where ext_proc did not count it:
    retries, resets, failed health checks (the ring changed), ext_proc timeouts."""
    text = httpx.get(f"http://127.0.0.1:{stack.admin_port}/stats", timeout=5).text
    return dict(
        line.split(": ", 1)
        for line in text.splitlines()
        if (
            line.startswith("cluster.models.")
            and ("retry" in line or "reset" in line or "health_check.failure" in line)
            or line.startswith("http.data_plane.ext_proc.")
            and "timeout" in line
        )
        and not line.endswith(": 0")
    )


async def fleet_in_flight(namespace: str) -> dict[bytes, bytes]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for _ in range(100):
            counts = await client.hgetall(f"{namespace}inflight")
            if not counts:
                break
            await asyncio.sleep(0.05)
        return counts  # type: ignore[no-any-return]
    finally:
        await client.aclose()


async def test_a_hot_prefix_spills_to_stable_homes_and_never_overloads_one(
    procs: ProcessReaper, log_dir: Path, namespace: str
) -> None:
    stack = spill_stack(procs, log_dir, namespace)
    below = await burst(stack, 10)
    assert len(below) == 1, f"below the threshold no request leaves home: {below}"
    home = next(iter(below))

    async with PeakSampler(stack) as sampler:
        first = await burst(stack, 100)
    assert max(sampler.peak.values()) <= THRESHOLD, (sampler.peak, uncounted_routing_stats(stack))
    assert len(first) == math.ceil(100 / THRESHOLD), first
    assert first[home] == THRESHOLD

    second = await burst(stack, 100)
    assert set(second) == set(first), "a second burst uses the same instances"

    async with PeakSampler(stack) as sampler:
        wide = await burst(stack, 160)
    assert len(wide) == INSTANCES, wide
    assert max(sampler.peak.values()) <= math.ceil(160 / INSTANCES) + 1, (
        sampler.peak,
        wide,
        uncounted_routing_stats(stack),
    )
    assert await fleet_in_flight(namespace) == {}


async def test_with_spill_disabled_everything_stays_home(
    procs: ProcessReaper, log_dir: Path, namespace: str
) -> None:
    stack = spill_stack(procs, log_dir, namespace, policy="none")
    served = await burst(stack, 100)
    assert len(served) == 1 and sum(served.values()) == 100
    assert await fleet_in_flight(namespace) == {}


async def test_a_new_prefix_starts_beside_its_busy_ring_pick_and_stays_there(
    procs: ProcessReaper, log_dir: Path, namespace: str
) -> None:
    stack = spill_stack(procs, log_dir, namespace)
    table = RoutingTable.build(stack.fleet, stack.config)

    def ring_of(prompt: str) -> list[str]:
        """The prompt's ring candidates as instance ports (the simulator's names)."""
        key = extract_key(chat_body(prompt), settings=table.key_settings).value
        return [table.ids[c].rsplit(":", 1)[1] for c in table.lookup(key)[0]]

    busy = ring_of(HOT_PROMPT)[0]
    prompts = (f"A cold prompt, number {i}. " * 30 for i in range(5000))
    cold = next(p for p in prompts if ring_of(p)[0] == busy)
    url = f"{stack.url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        hot = asyncio.gather(*(client.post(url, content=chat_body(HOT_PROMPT)) for _ in range(8)))
        redis = aioredis.Redis.from_url(REDIS_URL)
        try:
            for _ in range(200):  # until the 8 are in flight on the hot prefix's home
                if int(await redis.hget(f"{namespace}inflight", f"127.0.0.1:{busy}") or 0) >= 8:
                    break
                await asyncio.sleep(0.01)
        finally:
            await redis.aclose()
        first = await client.post(url, content=chat_body(cold))
        assert {a.headers["x-sim-instance"] for a in await hot} == {busy}  # below the threshold
    placed = first.headers["x-sim-instance"]
    width = stack.config.placement.width
    assert placed != busy and placed in ring_of(cold)[:width], (placed, ring_of(cold))
    later = await burst(stack, 4, prompt=cold)  # the ring pick is idle again: no matter
    assert set(later) == {placed}
    assert await fleet_in_flight(namespace) == {}
