"""What one run (one workload under one policy) measured, live or simulated.

Times are in model seconds (simulated seconds for the simulator, wall seconds for a real
fleet). A :class:`RunResult` keeps every request's outcome plus the fleet's counters, so
reports and plots are computed from the records and a result can be saved as JSON and
re-read (``prefix-router bench report``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.bounds import CacheBounds


@dataclass(slots=True)
class RequestRecord:
    arrival_s: float
    """When it was sent, from the start of the run."""
    instance: str | None
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    ttft_floor_s: float | None = None
    """The least TTFT any router could give it (DES): one engine step prefilling only the
    tokens no earlier request left behind (:class:`bench.bounds.BoundsTracker`'s infinite
    cache), with no wait for a step under way and no other work in it."""


@dataclass(slots=True)
class InstanceStats:
    id: str
    requests: int = 0
    peak_in_flight: int = 0
    busy: float | None = None
    """Fraction of the run the engine was stepping (simulator only)."""
    queries: int = 0
    hits: int = 0
    mean_ttft_s: float | None = None
    """Instance-side mean TTFT (histogram sum / count)."""


@dataclass(slots=True)
class RunResult:
    mode: str
    """``live`` or ``des``."""
    workload: str
    policy: str
    params: str
    records: list[RequestRecord]
    instances: list[InstanceStats]
    duration_s: float
    """First arrival to last completion."""
    bounds: CacheBounds | None = None
    time_scale: float = 1.0
    notes: dict[str, Any] = field(default_factory=dict)
    windows: list[tuple[float, float]] = field(default_factory=list)
    """``(window start s, token hit rate)`` over arrival time (DES)."""
    events: list[tuple[float, str]] = field(default_factory=list)
    """``(time s, what)``: fleet resizes."""

    # -- summaries ----------------------------------------------------------------------

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None and r.ttft_s is not None]

    @property
    def errors(self) -> int:
        return sum(1 for r in self.records if r.error is not None)

    @property
    def hit_rate(self) -> float:
        queries = sum(i.queries for i in self.instances)
        return sum(i.hits for i in self.instances) / queries if queries else 0.0

    def ttfts(self) -> list[float]:
        return sorted(r.ttft_s for r in self.ok if r.ttft_s is not None)

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts(), q)

    def e2e(self, q: float) -> float:
        return percentile(sorted(r.e2e_s for r in self.ok if r.e2e_s is not None), q)

    @property
    def throughput_rps(self) -> float:
        return len(self.ok) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_tps(self) -> float:
        tokens = sum(r.output_tokens for r in self.ok)
        return tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def peak_in_flight(self) -> int:
        return max((i.peak_in_flight for i in self.instances), default=0)

    @property
    def min_busy(self) -> float | None:
        busy = [i.busy for i in self.instances if i.busy is not None]
        return min(busy) if busy else None

    @property
    def mean_busy(self) -> float | None:
        busy = [i.busy for i in self.instances if i.busy is not None]
        return sum(busy) / len(busy) if busy else None

    # -- persistence --------------------------------------------------------------------

    def to_json(self) -> bytes:
        data = dataclasses.asdict(self)
        keys = [f.name for f in dataclasses.fields(RequestRecord)]
        data["records"] = {k: [getattr(r, k) for r in self.records] for k in keys}
        return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)

    @classmethod
    def from_json(cls, raw: bytes) -> RunResult:
        data = orjson.loads(raw)
        columns = data.pop("records")
        count = len(next(iter(columns.values()), []))
        records = [RequestRecord(**{k: v[i] for k, v in columns.items()}) for i in range(count)]
        instances = [InstanceStats(**i) for i in data.pop("instances")]
        bounds = data.pop("bounds")
        return cls(
            records=records,
            instances=instances,
            bounds=CacheBounds(**bounds) if bounds else None,
            windows=[(float(a), float(b)) for a, b in data.pop("windows")],
            events=[(float(a), str(b)) for a, b in data.pop("events")],
            **data,
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.to_json())

    @classmethod
    def load(cls, path: Path) -> RunResult:
        return cls.from_json(path.read_bytes())


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))
