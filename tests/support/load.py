"""Continuous load through Envoy from background threads, every outcome recorded."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, slots=True)
class Outcome:
    started: float
    """``time.monotonic()`` when the request was sent."""
    status: int
    """HTTP status, or 0 when the request failed without one."""
    backend: str | None
    prefix_key: str | None = None
    error: str | None = None
    ended: float = float("inf")
    """``time.monotonic()`` when the answer (or the error) came."""


@dataclass
class Load:
    url: str
    workers: int = 2
    model: str = "m"
    max_tokens: int | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def __enter__(self) -> Load:
        for _ in range(self.workers):
            t = threading.Thread(target=self._run, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                request: dict[str, object] = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": f"p{next(self._ids)}"}],
                }
                if self.max_tokens is not None:
                    request["max_tokens"] = self.max_tokens
                body = json.dumps(request)
                started = time.monotonic()
                try:
                    r = client.post(f"{self.url}/v1/chat/completions", content=body)
                    answer = r.json() if r.status_code == 200 else {}
                    self.outcomes.append(
                        Outcome(
                            started,
                            r.status_code,
                            answer.get("backend"),
                            answer.get("prefix_key"),
                            ended=time.monotonic(),
                        )
                    )
                except (httpx.HTTPError, ValueError) as exc:
                    self.outcomes.append(
                        Outcome(started, 0, None, error=repr(exc), ended=time.monotonic())
                    )

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]

    def first_from(self, backend: str, after: float) -> float | None:
        times = [o.started for o in self.outcomes if o.backend == backend and o.started >= after]
        return min(times) if times else None

    def served_by(self, backend: str, after: float = 0.0) -> int:
        return sum(1 for o in self.outcomes if o.backend == backend and o.started >= after)
