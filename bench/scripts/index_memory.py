"""Redis memory of the routing state after 100k distinct prefixes, and after 100k more.

Routes ``--prefixes`` requests whose prompts all differ from their first byte (so every
block of each is new to the index) through the Redis store, with the default settings
(the prefix index at ``index.slots_log2`` 18, 4-way; 8 instances), releasing each; then
reports ``MEMORY USAGE`` of every key of the namespace, by kind, and the change of
``INFO memory``'s ``used_memory``; then does it again with as many new prefixes. The index
is one fixed-size string, so the second round must not grow it.

    python bench/scripts/index_memory.py [--redis-url URL] [--prefixes 100000] [--out FILE]

The namespace's keys are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections import defaultdict
from pathlib import Path

import redis.asyncio as aioredis
import uvloop

from bench.scripts._harness import ROOT
from ext_proc.router import RequestRouter
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.index import ENTRY_BYTES, SLOT_BYTES, WAYS
from prefix_router.core.table import RoutingTable
from prefix_router.state.routing.redis_store import RedisStore

PATH = "/v1/chat/completions"
CONCURRENT = 32
FILLER = "lorem ipsum dolor sit amet " * 40


def body(n: int) -> bytes:
    """A ~1 KB chat body whose prompt starts with ``n``: a prefix of its own."""
    messages = [
        {"role": "system", "content": f"{n:09d} {FILLER}"},
        {"role": "user", "content": "hi"},
    ]
    return json.dumps({"model": "m", "messages": messages}).encode()


async def route_many(router: RequestRouter, first: int, count: int) -> int:
    """Route prefixes ``first .. first + count``, ``CONCURRENT`` at a time; the decisions
    made on the store's own state (Redis too slow for a moment) are counted."""
    degraded = 0

    async def worker(offset: int) -> None:
        nonlocal degraded
        for n in range(first + offset, first + count, CONCURRENT):
            result = await router.route(body(n), path=PATH, tenant="")
            degraded += result.decision.outcome == "ring_only"
            router.finish(result)

    await asyncio.gather(*(worker(i) for i in range(CONCURRENT)))
    return degraded


async def usage(client: aioredis.Redis, namespace: str) -> tuple[dict[str, int], int, int]:
    """``MEMORY USAGE`` summed by kind of key, ``used_memory``, and the index entries in use
    (a tag that is not 0: :mod:`prefix_router.core.index`)."""
    by_kind: dict[str, int] = defaultdict(int)
    entries = 0
    async for key in client.scan_iter(match=f"{namespace}*"):
        kind = key.decode()[len(namespace) :].split(":")[0]
        by_kind[kind] += await client.memory_usage(key, samples=0) or 0
        if kind == "index":
            table = await client.get(key) or b""
            entries = sum(table[i : i + 2] != b"\0\0" for i in range(0, len(table), ENTRY_BYTES))
    info = await client.info("memory")
    return dict(by_kind), int(info["used_memory"]), entries


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--prefixes", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/index_memory.md")
    args = parser.parse_args()
    config = RouterConfig()
    table = RoutingTable.build(Fleet.of([Instance("10.0.0.1", 8000 + i) for i in range(8)]), config)
    namespace = f"bench-index-{uuid.uuid4().hex[:6]}:"
    client = aioredis.Redis.from_url(args.redis_url)
    store = await RedisStore.connect(args.redis_url, namespace=namespace, timeout_s=0.5)
    router = RequestRouter(table, store)
    rows = []
    try:
        _, before, _ = await usage(client, namespace)
        for round_ in range(2):
            started = time.perf_counter()
            degraded = await route_many(router, round_ * args.prefixes, args.prefixes)
            took = time.perf_counter() - started
            await asyncio.sleep(0.1)  # the last writes ride on a timer of a few ms
            kinds, used, entries = await usage(client, namespace)
            rows.append((round_ + 1, kinds, used - before, entries, took, degraded))
    finally:
        await store.close()
        keys = [k async for k in client.scan_iter(match=f"{namespace}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    slots = 2**config.index.slots_log2
    lines = [
        "# Redis memory of the routing state",
        "",
        "`python bench/scripts/index_memory.py"
        + (f" --prefixes {args.prefixes}`" if args.prefixes != 100_000 else "`"),
        "",
        f"{args.prefixes:,} distinct ~1 KB prompts per round (every block new to the index), "
        f"{CONCURRENT} at a time, each released; default settings: index slots_log2 "
        f"{config.index.slots_log2}, 4-way (the table's bound: {slots:,} slots x "
        f"{SLOT_BYTES} bytes = {slots * SLOT_BYTES / 2**20:.0f} MiB), 8 instances. "
        "`MEMORY USAGE` of the namespace's keys by kind, bytes:",
        "",
        "| after | prefixes | index | index entries in use | index log | work | other "
        "| used_memory delta | routing s | decided without Redis |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for round_, kinds, delta, entries, took, degraded in rows:
        other = sum(v for k, v in kinds.items() if k not in ("index", "index-log", "work"))
        lines.append(
            f"| round {round_} | {round_ * args.prefixes:,} | {kinds.get('index', 0):,} "
            f"| {entries:,} of {slots * WAYS:,} | {kinds.get('index-log', 0):,} "
            f"| {kinds.get('work', 0):,} "
            f"| {other:,} | {delta:,} "
            f"| {took:.1f} | {degraded} |"
        )
    print("\n".join(lines))
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    uvloop.run(main())
