"""What ``prefix-router up`` tells the control plane about the processes it supervises.

``up`` restarts whatever of its stack exits (:mod:`prefix_router.ops.supervise`);
the control plane shows those restarts on its status page and counts them in its
metrics. Neither imports the other: this document in Redis, next to the state
they already share, is the whole contract::

    <ns>supervision  string  JSON SupervisionReport, expires REPORT_TTL_S after its last write

``up`` rewrites it whole every few seconds and at every event, so it is back
within seconds after Redis itself restarted empty, and it disappears by itself
when ``up`` is gone (killed without a chance to delete it). Without ``up`` (compose,
Kubernetes: the orchestrator restarts containers) there is no such key and the
status page shows no process table.

The report is bounded: :data:`KEEP_EVENTS` events of at most :data:`TAIL_CHARS`
characters of log each.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

REPORT_TTL_S = 15.0
KEEP_EVENTS = 20
TAIL_CHARS = 4000


def supervision_key(namespace: str) -> str:
    return f"{namespace}supervision"


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentReport:
    """One supervised process now."""

    name: str
    pid: int | None
    state: str
    """``running``, ``waiting`` (exited, restart pending) or ``starting``."""
    restarts: int
    last_exit: str | None = None
    """Exit status of the last unexpected exit: ``killed by SIGKILL``, ``exit code 1``."""
    last_exit_time: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisionEvent:
    """``kind`` ``exit``: it exited (status, uptime, restart delay, its log's last lines);
    ``back``: restarted and serving again (``down_s`` after it exited)."""

    time: float
    component: str
    kind: str
    pid: int | None = None
    status: str | None = None
    uptime_s: float | None = None
    restart_in_s: float | None = None
    log_tail: str | None = None
    down_s: float | None = None
    restarts: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisionReport:
    supervisor_pid: int
    updated: float
    components: tuple[ComponentReport, ...]
    events: tuple[SupervisionEvent, ...]
    """Newest first."""

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> SupervisionReport:
        """Parse a stored report; :class:`ValueError` if it is not one."""
        try:
            doc = json.loads(raw)
            return cls(
                supervisor_pid=int(doc["supervisor_pid"]),
                updated=float(doc["updated"]),
                components=tuple(ComponentReport(**c) for c in doc["components"]),
                events=tuple(_event(e) for e in doc["events"][:KEEP_EVENTS]),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a supervision report: {exc!r}") from None


def _event(doc: dict[str, Any]) -> SupervisionEvent:
    tail = doc.get("log_tail")
    return SupervisionEvent(**{**doc, "log_tail": tail[-TAIL_CHARS:] if tail else tail})


def write_report(
    client: redis.Redis, namespace: str, report: SupervisionReport, *, ttl_s: float = REPORT_TTL_S
) -> None:
    """Store ``report`` (whole); raises :class:`redis.RedisError` / ``OSError`` if Redis fails."""
    client.set(supervision_key(namespace), report.to_json(), px=int(ttl_s * 1000))


async def read_report(client: aioredis.Redis, namespace: str) -> SupervisionReport | None:
    """The current report; ``None`` without one (no ``up``), or if unreadable or Redis fails."""
    try:
        raw = await client.get(supervision_key(namespace))
        return None if raw is None else SupervisionReport.from_json(raw)
    except (RedisError, OSError, ValueError):
        return None


__all__ = [
    "REPORT_TTL_S",
    "ComponentReport",
    "SupervisionEvent",
    "SupervisionReport",
    "read_report",
    "supervision_key",
    "write_report",
]
