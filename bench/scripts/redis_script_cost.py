"""What one routing round trip costs Redis, by fleet size and queue length.

Every decision batch runs one script call (``prefix_router.state.routing.redis_lua.SYNC``),
and Redis runs scripts one at a time on one core: the script's time bounds how many
batches the whole router can make per second. This fills each instance's prefill queue
with ``waiting`` requests (through the script's own admits, so any version's format
works), then times, as Redis itself counts it (``INFO commandstats``):

* ``read``: the reads of one batch (every instance's queue and counts, 8 index slots);
* ``admit``: one routed request's writes (reserve, queue, index entry) and the reads.

``--baseline REV`` runs the script of another git revision on the same Redis in the same
run, for a ratio.

    python -m bench.scripts.redis_script_cost [--baseline f891976] [--instances 8,64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import redis

from prefix_router.core.index import EntryWrite
from prefix_router.state.routing import redis_lua

ROOT = Path(__file__).resolve().parents[2]
MODULE = "prefix_router/state/routing/redis_lua.py"


def script_of(rev: str | None) -> types.ModuleType:
    """``redis_lua`` as of git revision ``rev`` (None: this tree's)."""
    if rev is None:
        return redis_lua
    source = subprocess.run(
        ["git", "show", f"{rev}:{MODULE}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(f"redis_lua_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{MODULE}", "exec"), module.__dict__)  # noqa: S102 - our own file
    return module


def per_call_us(client: redis.Redis, calls: list[tuple[str, list[str], bytes]]) -> float:
    client.config_resetstat()
    for sha, keys, arg in calls:
        client.evalsha(sha, len(keys), *keys, arg)
    stats = client.info("commandstats")["cmdstat_evalsha"]
    return float(stats["usec_per_call"])


def measure(
    client: redis.Redis, lua: types.ModuleType, instances: int, waiting: int, n: int
) -> tuple[float, float]:
    ns = f"bench-script-{uuid.uuid4().hex[:8]}:"
    keys = [f"{ns}{k}" for k in ("inflight", "share", "decisions", "spills", "index:18", "work")]
    ids = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(instances)]
    sha = client.script_load(lua.SYNC)
    later = time.time() + 3600.0  # prefill that ends an hour from now: still waiting
    try:
        for instance in ids:  # fill each queue through the script itself
            fill = lua.SyncArgs(
                admits=[(instance, later, 1.0, 1.0, 1e6, "placed", "", "")] * waiting, keep=256
            )
            client.evalsha(sha, len(keys), *keys, fill.pack())
        slots = [1000 + 997 * j for j in range(8)]
        read = lua.SyncArgs(instances=ids, slots=slots, keep=256).pack()
        read_us = per_call_us(client, [(sha, keys, read)] * n)
        admits = []
        for j in range(n):
            args = lua.SyncArgs(
                reserves=[ids[j % instances]],
                admits=[(ids[j % instances], time.time(), 1.0, 1.0, 1e9, "home", "", "")],
                writes=[EntryWrite(slots[j % 8], 0, bytes(8), j.to_bytes(8, "big"))],
                instances=ids,
                slots=slots,
                keep=256,
            )
            admits.append((sha, keys, args.pack()))
        return read_us, per_call_us(client, admits)
    finally:
        client.delete(*keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--baseline", help="git revision whose script to compare")
    parser.add_argument("--instances", default="8,64")
    parser.add_argument("--waiting", default="0,16,64,256")
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    client = redis.Redis.from_url(args.redis_url)
    versions = {"this tree": script_of(None)}
    if args.baseline:
        versions[args.baseline] = script_of(args.baseline)
    print("| instances | waiting each | script | read us | admit us |")
    print("|---|---|---|---|---|")
    for instances in map(int, args.instances.split(",")):
        for waiting in map(int, args.waiting.split(",")):
            for name, lua in versions.items():
                read_us, admit_us = measure(client, lua, instances, waiting, args.n)
                print(f"| {instances} | {waiting} | {name} | {read_us:.0f} | {admit_us:.0f} |")
    client.close()


if __name__ == "__main__":
    main()
