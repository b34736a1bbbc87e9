"""What the load store keeps in Redis, read by the control plane for metrics and the status page.

The keys are written by :mod:`prefix_router.state.routing.redis_store` (its module
docstring has the layout); this module only reads them, in one pipelined
round trip bounded by a timeout:

``<ns>inflight``   hash  instance id -> fleet-wide in-flight count
``<ns>decisions``  hash  outcome (``home``, ``spilled``) -> decisions counted in Redis
``<ns>spills``     list  the last 100 spills, newest first, JSON
                         ``{time, home, to, home_in_flight, request_id}``

Decisions routed by the ring alone (Redis unavailable) are not in Redis; each
ext_proc replica counts those in ``prefix_router_ext_proc_decisions_total``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

__all__ = ["LoadsReading", "read_loads"]


@dataclass(frozen=True, slots=True)
class LoadsReading:
    """One read of the load store's keys. ``error`` set: Redis did not answer in time."""

    in_flight: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)
    spills: tuple[dict[str, Any], ...] = ()
    error: str | None = None

    @property
    def available(self) -> bool:
        return self.error is None

    @property
    def predicted_affinity(self) -> float | None:
        """Share of load-checked decisions that went home, since the namespace was created."""
        return affinity(self.decisions.get("home", 0), self.decisions.get("spilled", 0))


def affinity(home: float, spilled: float) -> float | None:
    """``home / (home + spilled)``; ``None`` when there was no decision."""
    total = home + spilled
    return home / total if total > 0 else None


async def read_loads(
    client: aioredis.Redis, namespace: str, *, spills: int = 20, timeout_s: float = 0.5
) -> LoadsReading:
    """In-flight counts, decision counts and the newest ``spills`` spills, in one round trip."""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.pipeline(transaction=False) as pipe:
                pipe.hgetall(f"{namespace}inflight")
                pipe.hgetall(f"{namespace}decisions")
                pipe.lrange(f"{namespace}spills", 0, max(0, spills - 1))
                raw_in_flight, raw_decisions, raw_spills = await pipe.execute()
    except (RedisError, OSError, TimeoutError) as exc:
        return LoadsReading(error=repr(exc))
    return LoadsReading(
        in_flight={_text(k): max(0, int(v)) for k, v in raw_in_flight.items()},
        decisions={_text(k): int(v) for k, v in raw_decisions.items()},
        spills=tuple(_spill(s) for s in raw_spills),
    )


def _spill(raw: bytes | str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        return {"error": "unreadable spill entry"}
    return doc if isinstance(doc, dict) else {"error": "unreadable spill entry"}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
