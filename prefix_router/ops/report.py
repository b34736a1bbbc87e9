"""Hand the supervisor's report to the control plane, through the stack's Redis.

``up``'s loop calls :meth:`ReportPublisher.publish` after every poll; it writes
at once after an event and otherwise every ``interval_s``, so the report
(which expires after :data:`~prefix_router.state.supervision.REPORT_TTL_S`)
stays fresh and is back within ``interval_s`` after Redis restarted empty.
Every Redis call is bounded by ``timeout_s``: a dead or hung Redis delays the
supervisor's loop by that much at most, once per interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from prefix_router.state.supervision import SupervisionReport, write_report


class ReportPublisher:
    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self.interval_s = interval_s
        self.clock = clock
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._next = 0.0
        self.failing = False
        """The last write failed (Redis down or restarting)."""

    def publish(self, report: Callable[[], SupervisionReport], *, now: bool = False) -> bool:
        """Write ``report()`` if ``now`` or due; returns whether a write succeeded."""
        if not now and self.clock() < self._next:
            return False
        self._next = self.clock() + self.interval_s
        try:
            write_report(self.client, self.namespace, report())
        except (redis.RedisError, OSError):
            self.failing = True
            return False
        self.failing = False
        return True

    def close(self) -> None:
        self.client.close()


__all__ = ["ReportPublisher"]
