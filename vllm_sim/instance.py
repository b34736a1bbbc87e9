"""One simulated vLLM server: engine, faults and identity; the service layer behind the API.

The HTTP shell (:mod:`vllm_sim.app`) parses, calls :meth:`SimInstance.submit`, and writes the
result; the instance owns nothing HTTP-specific. The engine's step task is started lazily on
the first request, so an app driven in-process (httpx.ASGITransport, no lifespan) works too.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from vllm_sim.config import EngineConfig
from vllm_sim.engine import Engine, RequestHandle
from vllm_sim.faults import Fault, FaultMode, FaultSwitch
from vllm_sim.metrics import EngineCollector, render_metrics
from vllm_sim.protocol import ApiRequest


class SimInstance:
    """A named simulated server; ``name`` is echoed in the ``x-sim-instance`` header."""

    def __init__(self, config: EngineConfig, *, name: str, engine_index: int = 0) -> None:
        self.config = config
        self.name = name
        self.engine = Engine(config)
        self.faults = FaultSwitch(on_change=self._apply_fault)
        self.collector = EngineCollector(self.engine, engine_index=engine_index)
        self.created = int(time.time())
        self._serial = itertools.count()
        self._id_prefix = f"{os.getpid():x}{id(self) & 0xFFFF:04x}"

    def __repr__(self) -> str:
        return f"SimInstance(name={self.name!r}, model={self.config.model!r})"

    def next_id(self) -> str:
        """A response id unique within the process."""
        return f"{self._id_prefix}{next(self._serial):08x}"

    def submit(self, request: ApiRequest, *, request_id: str | None = None) -> RequestHandle:
        self.engine.start()
        return self.engine.submit(request.params, request_id=request_id)

    def abort(self, handle: RequestHandle) -> None:
        self.engine.abort(handle)

    async def stop(self) -> None:
        """Fail waiting callers fast (503) and stop the engine; hung requests are released."""
        self.faults.set(Fault(mode=FaultMode.UNHEALTHY))
        await self.engine.stop()

    def _apply_fault(self, fault: Fault) -> None:
        if fault.mode is FaultMode.HANG:
            self.engine.pause()
        else:
            self.engine.resume()

    def metrics_text(self) -> bytes:
        return render_metrics(self.collector)

    def state(self) -> dict[str, Any]:
        """Live counts for ``GET /sim/state``."""
        engine, stats = self.engine, self.engine.stats
        return {
            "name": self.name,
            "model": self.config.model,
            **engine.scheduler.snapshot(),
            "num_gpu_blocks": self.config.num_gpu_blocks,
            "block_size": self.config.block_size,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "preemptions": stats.preemptions,
            "finished": dict(stats.finished),
            "steps": engine.steps,
            "sim_time_s": engine.now(),
            "time_scale": self.config.time_scale,
            "fault": self.faults.current.to_json(),
        }
