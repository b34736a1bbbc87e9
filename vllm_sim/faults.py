"""Runtime fault injection for one instance (``POST /sim/fault``).

Modes:
    none       normal service
    unhealthy  ``/health`` and every API request answer 503
    hang       requests and ``/health`` never answer and the engine freezes, until cleared
    slow       every API request and ``/health`` waits ``extra_latency_ms`` first

``extra_latency_ms`` is wall-clock time, not divided by ``time_scale``: it models a slow
network or host as the router's timeouts see it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vllm_sim.errors import BadRequestError
from vllm_sim.protocol import load_object


class FaultMode(StrEnum):
    NONE = "none"
    UNHEALTHY = "unhealthy"
    HANG = "hang"
    SLOW = "slow"


@dataclass(frozen=True, slots=True)
class Fault:
    mode: FaultMode = FaultMode.NONE
    extra_latency_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "extra_latency_ms": self.extra_latency_ms}


def parse_fault(body: bytes) -> Fault:
    """``{"mode": ..., "extra_latency_ms": ...}``; ``slow`` without a latency means 200 ms."""
    data = load_object(body)
    try:
        mode = FaultMode(data.get("mode", "none"))
    except (ValueError, TypeError):
        modes = ", ".join(m.value for m in FaultMode)
        raise BadRequestError(f"'mode' must be one of {modes}.", param="mode") from None
    latency = data.get("extra_latency_ms", 200.0 if mode is FaultMode.SLOW else 0.0)
    if (
        isinstance(latency, bool)
        or not isinstance(latency, int | float)
        or not (math.isfinite(latency) and latency >= 0)
    ):
        raise BadRequestError("'extra_latency_ms' must be a number >= 0.", param="extra_latency_ms")
    return Fault(mode=mode, extra_latency_ms=float(latency))


class FaultSwitch:
    """The current fault and the event that hung requests wait on."""

    def __init__(self, on_change: Callable[[Fault], None] | None = None) -> None:
        self.current = Fault()
        self._on_change = on_change
        self._not_hanging = asyncio.Event()
        self._not_hanging.set()

    def set(self, fault: Fault) -> None:
        self.current = fault
        if fault.mode is FaultMode.HANG:
            self._not_hanging.clear()
        else:
            self._not_hanging.set()
        if self._on_change is not None:
            self._on_change(fault)

    async def admit(self) -> bool:
        """Apply the fault to an incoming request: hang, delay, or False for 503."""
        while self.current.mode is FaultMode.HANG:
            await self._not_hanging.wait()
        fault = self.current
        if fault.mode is FaultMode.UNHEALTHY:
            return False
        if fault.mode is FaultMode.SLOW and fault.extra_latency_ms > 0:
            await asyncio.sleep(fault.extra_latency_ms / 1000.0)
        return True
