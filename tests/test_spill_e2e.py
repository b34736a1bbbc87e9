"""Load against affinity through real Envoy, two ext_proc replicas sharing the routing
state in real Redis, and slow simulated vLLM instances."""

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
from prefix_router.core.decision import IN_FLIGHT_SLACK
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
    procs: ProcessReaper,
    log_dir: Path,
    namespace: str,
    policy: str = "least-work",
    ext_procs: int = 2,
) -> StaticStack:
    config = RouterConfig.model_validate(
        {"concurrency_threshold": THRESHOLD, "spill": {"policy": policy}}
    )
    return start_static_stack(
        procs,
        log_dir,
        backends=INSTANCES,
        ext_procs=ext_procs,
        config=config,
        sim_args=SIM_ARGS,
        ext_proc_args=["--redis-url", REDIS_URL, "--namespace", namespace],
    )


class PeakSampler:
    """Samples every instance's running + waiting requests until stopped; keeps the peak."""

    def __init__(self, stack: StaticStack) -> None:
        self.urls = [f"http://{i.id}/sim/state" for i in stack.fleet.instances]
        self.peak: Counter[str] = Counter()
        self.busy_samples = 0
        """Samples that saw some instance with a request: the peak measured something."""
        self._task: asyncio.Task[None] | None = None

    async def _run(self, client: httpx.AsyncClient) -> None:
        while True:
            states = await asyncio.gather(*(client.get(u) for u in self.urls))
            loads = []
            for state in states:
                body = state.json()
                load = body["running"] + body["waiting"]
                loads.append(load)
                self.peak[body["name"]] = max(self.peak[body["name"]], load)
            self.busy_samples += any(loads)
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> PeakSampler:
        self._client = httpx.AsyncClient(timeout=5)
        self._task = asyncio.create_task(self._run(self._client))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        [ended] = await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()
        if not isinstance(ended, asyncio.CancelledError):  # it failed while sampling
            raise AssertionError(f"the sampler stopped: {ended!r}")


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


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_hot_prefix_spreads_with_load_and_never_overloads_one(
    procs: ProcessReaper, log_dir: Path, namespace: str, replicas: int
) -> None:
    stack = spill_stack(procs, log_dir, namespace, ext_procs=replicas)
    alone = await burst(stack, 1)
    home = next(iter(alone))
    again = await burst(stack, 1)
    assert again == alone, "with nothing in flight the prefix's holder takes it"

    async with PeakSampler(stack) as sampler:
        served = await burst(stack, 100)
    # The in-flight bound is load_factor (1.4) x the fleet's mean + IN_FLIGHT_SLACK. One
    # replica decides a burst in order, each request seeing the ones before it. Replicas
    # see each other's decisions one Redis round trip late: a burst that reaches both at
    # once may fill an instance to the bound from each side (docs/reliability.md says so).
    bound = math.ceil(stack.config.spill.load_factor * 100 / INSTANCES + IN_FLIGHT_SLACK) * replicas
    assert sampler.busy_samples > 0, "no sample saw the burst"
    assert max(sampler.peak.values()) <= bound, (sampler.peak, uncounted_routing_stats(stack))
    assert sum(served.values()) == 100 and max(served.values()) <= bound, served
    assert len(served) >= 100 / bound and home in served, served
    assert await fleet_in_flight(namespace) == {}


async def test_with_spill_disabled_everything_stays_home(
    procs: ProcessReaper, log_dir: Path, namespace: str
) -> None:
    stack = spill_stack(procs, log_dir, namespace, policy="none")
    placed = await burst(stack, 1)
    served = await burst(stack, 100)
    assert served == {next(iter(placed)): 100}
    assert await fleet_in_flight(namespace) == {}


async def test_a_new_prefix_starts_beside_its_busy_ring_pick_and_stays_there(
    procs: ProcessReaper, log_dir: Path, namespace: str
) -> None:
    stack = spill_stack(procs, log_dir, namespace)
    table = RoutingTable.build(stack.fleet, stack.config)

    def ring_of(prompt: str) -> list[str]:
        """The prompt's first ring candidates as instance ports (the simulator's names)."""
        key = extract_key(chat_body(prompt), settings=table.key_settings).value
        return [table.ids[c].rsplit(":", 1)[1] for c in table.ring_order(key)]

    busy = next(iter(await burst(stack, 1)))
    prompts = (f"A cold prompt, number {i}. " * 30 for i in range(5000))
    cold = next(p for p in prompts if ring_of(p)[0] == busy)
    url = f"{stack.url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        # two in flight on the hot prefix's holder make it the busiest of the cold
        # prompt's ring candidates, so a prefix nobody holds starts elsewhere
        hot = asyncio.gather(*(client.post(url, content=chat_body(HOT_PROMPT)) for _ in range(2)))
        redis = aioredis.Redis.from_url(REDIS_URL)
        try:
            for _ in range(200):  # until both are in flight on the hot prefix's holder
                if int(await redis.hget(f"{namespace}inflight", f"127.0.0.1:{busy}") or 0) >= 2:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the hot requests never were in flight together")
        finally:
            await redis.aclose()
        first = await client.post(url, content=chat_body(cold))
        assert {a.headers["x-sim-instance"] for a in await hot} == {busy}  # within the bound
    placed = first.headers["x-sim-instance"]
    assert placed != busy and placed in ring_of(cold), (placed, ring_of(cold))
    later = await burst(stack, 1, prompt=cold)  # the ring pick is idle again: no matter
    assert set(later) == {placed}
    assert await fleet_in_flight(namespace) == {}
