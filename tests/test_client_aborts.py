"""Clients that give up: every count returns to 0, nothing leaks in ext_proc."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from prefix_router.ops.procs import free_port
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.figures import report
from tests.support.static_stack import start_static_stack
from tests.test_ext_proc_metrics import samples

pytestmark = pytest.mark.e2e

MODEL = "meta-llama/Llama-3.1-70B-Instruct"


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    """Streams one completion; 30% are aborted before the first token or mid-stream."""
    fate = rng.random()
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 24,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"abort test {rng.randrange(30)} " * 20}],
        }
    )
    async with client.stream("POST", url, content=body) as response:
        assert response.status_code == 200
        chunks = 0
        async for _ in response.aiter_lines():
            chunks += 1
            if fate < 0.15:
                return "aborted-before-first-token" if chunks == 1 else "aborted-mid-stream"
            if fate < 0.30 and chunks >= 1 + rng.randrange(1, 20):
                return "aborted-mid-stream"
    return "completed"


async def test_thousand_requests_with_30_percent_aborts_leak_nothing(
    procs: ProcessReaper, log_dir: Path, namespace: str
) -> None:
    metrics_port = free_port()
    stack = start_static_stack(
        procs,
        log_dir,
        backends=4,
        sim_args=["--time-scale", "20"],
        ext_proc_args=[
            "--redis-url",
            REDIS_URL,
            "--namespace",
            namespace,
            "--metrics-port",
            str(metrics_port),
        ],
    )
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    tasks_at_rest = samples(metrics_url)[("prefix_router_ext_proc_asyncio_tasks", ())]
    rng = random.Random(11)
    url = f"{stack.url}/v1/chat/completions"
    outcomes: dict[str, int] = {}
    limits = httpx.Limits(max_connections=48, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        semaphore = asyncio.Semaphore(40)

        async def bounded() -> None:
            async with semaphore:
                fate = await one_request(client, url, rng)
                outcomes[fate] = outcomes.get(fate, 0) + 1

        await asyncio.gather(*(bounded() for _ in range(1000)))
    report("1,000 streamed requests, 30% aborted", **outcomes)
    assert sum(outcomes.values()) == 1000
    assert outcomes["completed"] < 800 and outcomes["aborted-mid-stream"] > 50, outcomes

    redis_client = aioredis.Redis.from_url(REDIS_URL)
    deadline = time.monotonic() + 30  # a generous deadline: the loop ends at rest
    try:
        while time.monotonic() < deadline:
            got = samples(metrics_url)
            counts = await redis_client.hgetall(f"{namespace}inflight")
            streams = got[("prefix_router_ext_proc_open_streams", ())]
            local = [v for (n, _), v in got.items() if n == "prefix_router_ext_proc_in_flight"]
            tasks = got[("prefix_router_ext_proc_asyncio_tasks", ())]
            if not counts and streams == 0 and set(local) == {0} and tasks <= tasks_at_rest:
                break
            await asyncio.sleep(0.1)
        assert counts == {}
        assert streams == 0
        assert set(local) == {0}
        assert tasks <= tasks_at_rest, (tasks, tasks_at_rest)
    finally:
        await redis_client.aclose()
