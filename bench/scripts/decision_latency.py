"""Latency of one routing decision: the key alone, the full decision on in-process state,
and the full decision with the fleet's routing state in Redis: by default on the replica's
copy of it (the index and every instance's queue, refreshed by each round trip), and with
``redis_max_staleness_ms`` 0, waiting for one round trip each (one script call: the index
slots of the request's blocks and every instance's queue).

    python bench/scripts/decision_latency.py [--redis-url redis://127.0.0.1:6379/0] [--n 5000]

Sequential decisions (one in flight at a time), 8 instances, a 4 KB chat body; prints
p50/p99 in microseconds and the difference Redis adds, then the CPU a request costs at a
paced rate, background work included (what the copy's refresh round trips cost). Every
count taken is given back and the namespace's keys are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis.asyncio as aioredis

from bench.scripts._harness import chat_body
from ext_proc.router import RequestRouter
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.key import extract_key
from prefix_router.core.table import RoutingTable
from prefix_router.state.routing import InProcessStore, RoutingStore
from prefix_router.state.routing.redis_store import RedisStore

PATH = "/v1/chat/completions"


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


async def time_decisions(
    store: RoutingStore, table: RoutingTable, body: bytes, n: int
) -> list[float]:
    router = RequestRouter(table, store)
    out = []
    for _ in range(n):
        started = time.perf_counter()
        result = await router.route(body, path=PATH, tenant="t")
        out.append((time.perf_counter() - started) * 1e6)
        router.finish(result)
        await asyncio.sleep(0)  # as a server's loop turns between requests: timers, I/O
    return out


async def paced_cpu(store: RoutingStore, table: RoutingTable, body: bytes, n: int) -> float:
    """ext_proc's CPU a request, in microseconds, at one request in flight every ~2 ms
    (routed, ~1 ms in flight, ended, ~1 ms idle): the decisions plus what the store does
    in the background between them (with Redis, the round trips that carry the writes
    and refresh the copy; ``time_decisions`` leaves those out)."""
    router = RequestRouter(table, store)
    started = time.process_time()
    for _ in range(n):
        result = await router.route(body, path=PATH, tenant="t")
        await asyncio.sleep(0.001)
        router.finish(result)
        await asyncio.sleep(0.001)
    return (time.process_time() - started) / n * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--paced", type=int, default=2000, help="requests of the paced runs")
    args = parser.parse_args()
    config = RouterConfig()
    table = RoutingTable.build(Fleet.of([Instance("10.0.0.1", 8000 + i) for i in range(8)]), config)
    body = chat_body(4096)

    key_only = []
    for _ in range(args.n):
        started = time.perf_counter()
        extract_key(body, settings=table.key_settings, path=PATH, tenant="t")
        key_only.append((time.perf_counter() - started) * 1e6)
    memory = await time_decisions(InProcessStore(), table, body, args.n)
    memory_paced = await paced_cpu(InProcessStore(), table, body, args.paced)
    namespace = f"bench-decision-{uuid.uuid4().hex[:6]}:"
    fleet = Fleet.of([Instance("10.0.0.1", 8000 + i) for i in range(8)])
    waiting_table = RoutingTable.build(fleet, config.patched({"redis_max_staleness_ms": 0}))
    store = await RedisStore.connect(args.redis_url, namespace=namespace, timeout_s=0.1)
    try:
        await time_decisions(store, table, body, 200)  # warm the connection, script, copy
        redis = await time_decisions(store, table, body, args.n)
        redis_paced = await paced_cpu(store, table, body, args.paced)
        await time_decisions(store, waiting_table, body, 200)
        redis_wait = await time_decisions(store, waiting_table, body, args.n)
    finally:
        await store.close()
        cleaner = aioredis.Redis.from_url(args.redis_url)
        keys = [k async for k in cleaner.scan_iter(match=f"{namespace}*")]
        if keys:
            await cleaner.delete(*keys)
        await cleaner.aclose()
    rows = {
        "key alone": key_only,
        "decision, in-process state": memory,
        "decision, state in Redis (on the replica's copy)": redis,
        "decision, state in Redis, a round trip each (redis_max_staleness_ms 0)": redis_wait,
    }
    print("| path | p50 us | p99 us |")
    print("|---|---|---|")
    stats = {name: percentiles(v) for name, v in rows.items()}
    for name, (p50, p99) in stats.items():
        print(f"| {name} | {p50:.0f} | {p99:.0f} |")
    for name in list(stats)[2:]:
        added50 = stats[name][0] - stats["key alone"][0]
        added99 = stats[name][1] - stats["key alone"][1]
        print(f"\n{name}: adds p50 {added50:.0f} us, p99 {added99:.0f} us over the key alone")
    print(
        "\nCPU a request, one every ~2 ms (background work included): "
        f"in-process state {memory_paced:.0f} us, state in Redis {redis_paced:.0f} us "
        f"(+{redis_paced - memory_paced:.0f} us: the round trips that write and refresh the copy)"
    )


if __name__ == "__main__":
    asyncio.run(main())
