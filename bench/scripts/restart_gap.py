"""How long each component of ``prefix-router up`` is gone when it is SIGKILLed, and what
clients see meanwhile.

Runs the stack as ``up`` does (its own Redis, simulated vLLM, control plane, ext_proc,
Envoy; the same supervisor loop, :func:`prefix_router.ops.up.supervise`, in a thread),
sends a closed loop of small chat completions through Envoy from ``--clients`` threads
(each retries at once after a failure, so the gap is sampled every few milliseconds),
and SIGKILLs each component ``--kills`` times, waiting for the stack to settle in
between. Per kill:

* ``client gap``: from the kill to the start of the first request sent after it that
  succeeded (0 when no request failed);
* ``supervisor``: from the exit to the restarted process's probe answering (Envoy: admin
  ``LIVE`` and the listener accepting), as the supervisor logged it (every kill here is a
  first restart, at once: the backoff of a crash loop is not measured);
* requests lost in flight (sent before the kill, failed) and requests failed while it was
  down (sent after the kill: the count only says how fast the clients retried), by kind
  (connection refused or reset, HTTP status).

Bounded: ``--kills`` per component, ``--settle`` seconds between kills, a 60 s deadline
for each restart. Loopback only. Not part of the test run.

    .venv/bin/python bench/scripts/restart_gap.py [--components envoy,redis] [--kills 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prefix_router.ops.procs import free_port
from prefix_router.ops.supervise import Back, Backoff, Event, State
from prefix_router.ops.up import Stack, resolve_settings, supervise

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
COMPONENTS = ("envoy", "ext_proc-0", "control-plane", "vllm-sim", "redis")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Outcome:
    started: float
    ended: float
    kind: str
    """``ok``, ``http NNN``, or the exception's class name."""


@dataclass
class Clients:
    """A closed loop of requests through Envoy from a few threads, every outcome kept."""

    url: str
    clients: int
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    status = client.post(self.url, json=body).status_code
                    kind = "ok" if status == 200 else f"http {status}"
                except httpx.HTTPError as exc:
                    kind = type(exc).__name__
                self.outcomes.append(Outcome(started, time.monotonic(), kind))

    def __enter__(self) -> Clients:
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(self.clients)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=15)


def wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {timeout} s")
        time.sleep(0.005)


def one_kill(stack: Stack, name: str, load: Clients, backs: list[Back]) -> dict[str, Any]:
    [component] = [c for c in stack.components if c.name == name]
    restarts = component.restarts
    seen = len(backs)
    from_ = len(load.outcomes)
    killed = time.monotonic()
    os.kill(component.proc.pid, signal.SIGKILL)
    wait(lambda: len(backs) > seen and backs[-1].component == name, f"{name} back")
    assert component.restarts == restarts + 1 and component.state is State.RUNNING
    wait(
        lambda: sum(o.kind == "ok" and o.started > killed for o in load.outcomes[from_:]) >= 20,
        "requests served after the restart",
    )
    window = load.outcomes[from_:]
    failed = [o for o in window if o.kind != "ok"]
    first_ok = min(o.started for o in window if o.kind == "ok" and o.started > killed)
    return {
        "component": name,
        "client_gap_s": (first_ok - killed) if failed else 0.0,
        "supervisor_s": backs[-1].down_s,
        "requests": len(window),
        "lost_in_flight": sum(o.started < killed for o in failed),
        "failed_while_down": sum(o.started >= killed for o in failed),
        "failed_by_kind": dict(Counter(o.kind for o in failed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--components", default=",".join(COMPONENTS))
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between kills")
    parser.add_argument("--json", help="also write the per-kill results here")
    args = parser.parse_args()
    names = args.components.split(",")
    unknown = set(names) - set(COMPONENTS)
    if unknown:
        parser.error(f"unknown components {sorted(unknown)}; choose from {COMPONENTS}")

    run_dir = tempfile.mkdtemp(prefix="restart-gap-")
    argv = [
        "--run-dir", run_dir, "--port", str(free_port()), "--admin-port", str(free_port()),
        "--envoy-admin-port", str(free_port()), "--xds-port", str(free_port()),
        "--instances", "2", "--ext-procs", "1", "--sim-time-scale", "100",
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # up's own Redis
    settings, config = resolve_settings(argv, environ)
    stack = Stack(settings, config)
    stop = threading.Event()
    backs: list[Back] = []

    def on_event(event: Event) -> None:
        if isinstance(event, Back):
            backs.append(event)

    # Every kill a first restart (immediate): runs of --settle seconds count as stable here,
    # so the figures are the restart itself, not the backoff a crash loop would add.
    backoff = Backoff(stable_s=max(0.5, args.settle / 2))
    supervisor = threading.Thread(
        target=supervise,
        args=(stack, stop),
        kwargs={"on_event": on_event, "backoff": backoff},
        daemon=True,
    )
    results: list[dict[str, Any]] = []
    try:
        stack.start()
        supervisor.start()
        url = f"http://{settings.host}:{settings.port}/v1/chat/completions"
        with Clients(url, args.clients) as load:
            wait(lambda: sum(o.kind == "ok" for o in load.outcomes) >= 50, "traffic")
            for name in names:
                for _ in range(args.kills):
                    time.sleep(args.settle)  # a stable run: each restart is a first one
                    result = one_kill(stack, name, load, backs)
                    print(json.dumps(result), flush=True)
                    results.append(result)
    finally:
        stop.set()
        supervisor.join(timeout=10)
        stack.stop()

    lines = [
        f"## Restart gaps: each component SIGKILLed {args.kills} times under a closed loop "
        f"of {args.clients} clients",
        "",
        "| component | client gap p50 / max (s) | supervisor: exit to serving p50 / max (s) "
        "| lost in flight (all kills) | failed while down (all kills) | failures by kind |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        rows = [r for r in results if r["component"] == name]
        gaps = [r["client_gap_s"] for r in rows]
        sup = [r["supervisor_s"] for r in rows]
        kinds: Counter[str] = Counter()
        for r in rows:
            kinds.update(r["failed_by_kind"])
        lines.append(
            f"| {name} | {statistics.median(gaps):.2f} / {max(gaps):.2f} "
            f"| {statistics.median(sup):.2f} / {max(sup):.2f} "
            f"| {sum(r['lost_in_flight'] for r in rows)} "
            f"| {sum(r['failed_while_down'] for r in rows)} "
            f"| {', '.join(f'{k} {v}' for k, v in sorted(kinds.items())) or '-'} |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
