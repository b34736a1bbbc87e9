"""Keep every process of ``prefix-router up`` running: restart what exits, with backoff.

A :class:`Supervisor` watches a list of :class:`Component` s. Each one is a
process plus how to start it again (same command, same ports, same log) and a
cheap probe that says it serves again. :meth:`Supervisor.poll`, called a few
times a second, moves each component through three states::

    running --exits--> waiting --delay passed--> starting --probe answers--> running
                          ^                         |
                          +-------exits, or not ready in start_timeout_s

Every exit is an :class:`Exit` event (exit status with the signal's name, how
long it had run, when it will be restarted, the last lines of its log), handed to
``on_event`` and kept (the newest :data:`KEEP_EVENTS`) for the status page. The
delay before a restart comes from :class:`Backoff`: the first restart is
immediate, each further one waits twice as long, capped, and a component that
served for ``stable_s`` before it exited starts from the first again. Nothing gives
up: only the caller (Ctrl-C, SIGTERM) stops the stack.

Whatever is left of an exited process's group is killed before the restart: a
child of a crashed component must not keep its port.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from prefix_router.ops.procs import ManagedProcess
from prefix_router.state.supervision import (
    KEEP_EVENTS,
    TAIL_CHARS,
    ComponentReport,
    SupervisionEvent,
    SupervisionReport,
)

TAIL_LINES = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """When to restart a component that exited: immediately the first time, then
    ``initial_s``, doubling up to ``max_s``, while it keeps exiting within ``stable_s``
    of its start."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    stable_s: float = 30.0

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s and self.factor >= 1 and self.stable_s > 0):
            raise ValueError(f"bad backoff: {self}")

    def failures_after(self, failures: int, serving_s: float) -> int:
        """Consecutive failures counting this exit, after serving ``serving_s`` seconds
        (0 if it never served): a stable run starts the count again."""
        return 1 if serving_s >= self.stable_s else failures + 1

    def delay_s(self, failures: int) -> float:
        """Seconds before the restart that follows the ``failures``-th consecutive exit."""
        if failures <= 1:
            return 0.0
        return min(self.max_s, self.initial_s * self.factor ** (failures - 2))


class State(Enum):
    RUNNING = "running"
    WAITING = "waiting"
    """Exited; restarts once its backoff delay has passed."""
    STARTING = "starting"
    """Restarted; not serving yet."""


@dataclass(frozen=True, slots=True)
class Exit:
    """One unexpected exit of a component."""

    time: float
    """Wall-clock seconds (``time.time()``)."""
    component: str
    pid: int | None
    status: str
    """``exit code 1``, ``killed by SIGKILL``, or why the start failed."""
    uptime_s: float
    restart_in_s: float
    log_path: str
    log_tail: str

    def message(self) -> str:
        lines = [
            f"{self.component} (pid {self.pid}) exited unexpectedly: {self.status}, "
            f"after {self.uptime_s:.1f} s; restarting in {self.restart_in_s:.1f} s. "
            f"Last lines of {self.log_path}:",
            *("    " + line for line in self.log_tail.splitlines()),
        ]
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Back:
    """A restarted component serves again."""

    time: float
    component: str
    pid: int
    restarts: int
    down_s: float
    """From the exit to the probe's first answer."""

    def message(self) -> str:
        return (
            f"{self.component} is back (pid {self.pid}, restart {self.restarts}), "
            f"{self.down_s:.2f} s after it exited"
        )


Event = Exit | Back


@dataclass(eq=False)
class Component:
    """One supervised process: how to start it again and how to tell that it serves."""

    name: str
    proc: ManagedProcess
    spawn: Callable[[], ManagedProcess]
    """Start the process again (same command, ports and log); must not wait for it."""
    ready: Callable[[], bool]
    """A quick, bounded probe: it serves."""
    state: State = State.RUNNING
    restarts: int = 0
    failures: int = 0
    """Consecutive exits without a stable run in between."""
    started: float | None = None
    """When its process started, on the supervisor's clock (first poll: just now)."""
    serving_since: float | None = None
    """When it was last seen serving; ``None`` while it has not since its start."""
    next_start: float = 0.0
    down_since: float | None = None
    last_exit: Exit | None = None


def _probe(c: Component) -> bool:
    """The component's probe; one that raises says "not yet", it never stops the loop."""
    try:
        return c.ready()
    except Exception:  # noqa: BLE001
        return False


def _tail(proc: ManagedProcess) -> str:
    return proc.tail(TAIL_LINES)[-TAIL_CHARS:]


@dataclass
class Supervisor:
    """Restarts the components that exit; see the module docstring."""

    components: Sequence[Component]
    backoff: Backoff = field(default_factory=Backoff)
    start_timeout_s: float = 60.0
    on_event: Callable[[Event], None] = lambda _event: None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=KEEP_EVENTS))

    def poll(self) -> list[Event]:
        """One pass over every component; returns the events it produced."""
        produced: list[Event] = []
        for component in self.components:
            event = self._step(component)
            if event is not None:
                produced.append(event)
                self.events.append(event)
                self.on_event(event)
        return produced

    def _step(self, c: Component) -> Event | None:
        now = self.clock()
        if c.started is None:
            c.started = c.serving_since = now
        if c.state is State.WAITING:
            if now >= c.next_start:
                return self._restart(c, now)
            return None
        status = c.proc.collect()
        if status is not None:
            return self._exited(c, now, status.describe())
        if c.state is State.STARTING:
            if _probe(c):
                c.state, c.serving_since = State.RUNNING, now
                down_s = now - (c.down_since if c.down_since is not None else now)
                c.down_since = None
                return Back(self.wall_clock(), c.name, c.proc.pid, c.restarts, down_s)
            if now - c.started > self.start_timeout_s:
                c.proc.kill()
                return self._exited(c, now, f"not serving {self.start_timeout_s:.0f} s after start")
        return None

    def _exited(self, c: Component, now: float, status: str) -> Exit:
        uptime = max(0.0, now - (c.started if c.started is not None else now))
        serving = now - c.serving_since if c.serving_since is not None else 0.0
        c.failures = self.backoff.failures_after(c.failures, serving)
        c.serving_since = None
        delay = self.backoff.delay_s(c.failures)
        c.state, c.next_start = State.WAITING, now + delay
        if c.down_since is None:
            c.down_since = now
        c.last_exit = Exit(
            time=self.wall_clock(),
            component=c.name,
            pid=c.proc.pid if c.proc.popen is not None else None,
            status=status,
            uptime_s=uptime,
            restart_in_s=delay,
            log_path=str(c.proc.log_path),
            log_tail=_tail(c.proc),
        )
        return c.last_exit

    def _restart(self, c: Component, now: float) -> Event | None:
        c.restarts += 1
        try:
            c.proc = c.spawn()
        except Exception as exc:  # the supervisor outlives any failure to start one process
            c.proc = c.proc.clone()  # not started: its exit is the failed start
            c.started = now
            return self._exited(c, now, f"could not start: {exc}")
        c.state, c.started = State.STARTING, now
        return None

    def report(self) -> SupervisionReport:
        """What the status page shows: each component now and the newest events first."""
        return SupervisionReport(
            supervisor_pid=os.getpid(),
            updated=self.wall_clock(),
            components=tuple(
                ComponentReport(
                    name=c.name,
                    pid=c.proc.pid if c.proc.popen is not None else None,
                    state=c.state.value,
                    restarts=c.restarts,
                    last_exit=c.last_exit.status if c.last_exit else None,
                    last_exit_time=c.last_exit.time if c.last_exit else None,
                )
                for c in self.components
            ),
            events=tuple(_event_report(e) for e in reversed(self.events)),
        )


def _event_report(event: Event) -> SupervisionEvent:
    if isinstance(event, Exit):
        return SupervisionEvent(
            time=event.time,
            component=event.component,
            kind="exit",
            pid=event.pid,
            status=event.status,
            uptime_s=event.uptime_s,
            restart_in_s=event.restart_in_s,
            log_tail=event.log_tail,
        )
    return SupervisionEvent(
        time=event.time,
        component=event.component,
        kind="back",
        pid=event.pid,
        down_s=event.down_s,
        restarts=event.restarts,
    )


__all__ = ["Back", "Backoff", "Component", "Event", "Exit", "State", "Supervisor"]
