"""The supervisor's rules (backoff table) and its state machine over real short processes.

The clock that schedules restarts is a fake one moved by the test, so backoff is
checked exactly; the processes are real, and the tests wait for their exits.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefix_router.ops.procs import ManagedProcess
from prefix_router.ops.supervise import Back, Backoff, Component, Exit, State, Supervisor
from prefix_router.state.supervision import SupervisionReport

BACKOFF = Backoff(initial_s=0.5, factor=2.0, max_s=4.0, stable_s=10.0)


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(1, 0.0), (2, 0.5), (3, 1.0), (4, 2.0), (5, 4.0), (6, 4.0), (50, 4.0)],
)
def test_backoff_restarts_at_once_then_doubles_up_to_the_cap(failures: int, delay: float) -> None:
    assert BACKOFF.delay_s(failures) == delay


@pytest.mark.parametrize(
    ("failures", "uptime_s", "after"),
    [(0, 0.1, 1), (1, 0.1, 2), (5, 9.9, 6), (5, 10.0, 1), (7, 3600.0, 1)],
)
def test_a_stable_run_starts_the_count_again(failures: int, uptime_s: float, after: int) -> None:
    assert BACKOFF.failures_after(failures, uptime_s) == after


@pytest.mark.parametrize(
    "bad",
    [
        {"initial_s": 0},
        {"initial_s": 5, "max_s": 1},
        {"factor": 0.5},
        {"stable_s": 0},
    ],
)
def test_a_bad_backoff_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="bad backoff"):
        Backoff(**bad)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SLEEPER = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(600)"]
CRASHER = [sys.executable, "-c", "import sys; print('bad config', flush=True); sys.exit(3)"]


@pytest.fixture
def started() -> Iterator[list[ManagedProcess]]:
    procs: list[ManagedProcess] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop(grace=2.0)


def component(
    tmp_path: Path,
    started: list[ManagedProcess],
    argv: list[str],
    *,
    ready: Callable[[], bool] = lambda: True,
) -> Component:
    def spawn() -> ManagedProcess:
        proc = ManagedProcess("worker", argv, tmp_path / "worker.log").start()
        started.append(proc)
        return proc

    return Component("worker", spawn(), spawn, ready)


def poll_until(supervisor: Supervisor, kind: type[Exit] | type[Back]) -> Exit | Back:
    """Poll (real time passes for the processes) until an event of ``kind``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for event in supervisor.poll():
            if isinstance(event, kind):
                return event
        time.sleep(0.01)
    raise AssertionError(f"no {kind.__name__} event")


def test_a_killed_process_is_restarted_reported_and_back(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    clock = FakeClock()
    worker = component(tmp_path, started, SLEEPER)
    seen: list[Exit | Back] = []
    supervisor = Supervisor(
        [worker], backoff=BACKOFF, on_event=seen.append, clock=clock, wall_clock=lambda: 5.0
    )
    assert supervisor.poll() == [] and worker.state is State.RUNNING
    first_pid = worker.proc.pid
    deadline = time.monotonic() + 30
    while "sleeping" not in worker.proc.tail() and time.monotonic() < deadline:
        time.sleep(0.01)
    clock.now += 3.0
    worker.proc.popen.send_signal(signal.SIGKILL)  # type: ignore[union-attr]

    exit_ = poll_until(supervisor, Exit)
    assert isinstance(exit_, Exit)
    assert (exit_.component, exit_.pid, exit_.status) == ("worker", first_pid, "killed by SIGKILL")
    assert exit_.uptime_s == pytest.approx(3.0, abs=0.01)
    assert exit_.restart_in_s == 0.0  # the first restart is immediate
    assert "sleeping" in exit_.log_tail and exit_.log_path.endswith("worker.log")
    assert "killed by SIGKILL" in exit_.message() and "    sleeping" in exit_.message()

    back = poll_until(supervisor, Back)
    assert isinstance(back, Back)
    assert worker.state is State.RUNNING and worker.restarts == 1
    assert back.pid == worker.proc.pid != first_pid and worker.proc.alive()
    assert seen == [exit_, back]

    report = supervisor.report()
    [row] = report.components
    assert (row.name, row.pid, row.state, row.restarts) == ("worker", back.pid, "running", 1)
    assert row.last_exit == "killed by SIGKILL"
    assert [e.kind for e in report.events] == ["back", "exit"]  # newest first
    assert SupervisionReport.from_json(report.to_json()) == report


def test_a_crash_loop_backs_off_and_a_stable_run_resets_it(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    clock = FakeClock()
    worker = component(tmp_path, started, CRASHER)
    supervisor = Supervisor([worker], backoff=BACKOFF, clock=clock)
    delays = []
    for _ in range(4):
        exit_ = poll_until(supervisor, Exit)
        assert isinstance(exit_, Exit) and exit_.status == "exit code 3"
        assert "bad config" in exit_.log_tail
        delays.append(exit_.restart_in_s)
        assert worker.state is State.WAITING
        if exit_.restart_in_s > 0:
            clock.now += exit_.restart_in_s - 0.01
            supervisor.poll()
            assert worker.state is State.WAITING  # not before its delay
            clock.now += 0.01
    assert delays == [0.0, 0.5, 1.0, 2.0]
    assert worker.restarts == 3

    # it runs stably for a while, then exits: the count starts again
    worker.spawn = lambda: _start(tmp_path, started, SLEEPER)
    clock.now += 2.0
    supervisor.poll()
    assert worker.state is State.STARTING
    supervisor.poll()
    assert worker.state is State.RUNNING
    clock.now += BACKOFF.stable_s
    worker.proc.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    exit_ = poll_until(supervisor, Exit)
    assert isinstance(exit_, Exit)
    assert exit_.status == "killed by SIGTERM" and exit_.restart_in_s == 0.0


def _start(tmp_path: Path, started: list[ManagedProcess], argv: list[str]) -> ManagedProcess:
    proc = ManagedProcess("worker", argv, tmp_path / "worker.log").start()
    started.append(proc)
    return proc


def test_a_restart_that_cannot_start_or_never_serves_counts_as_a_failure(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    clock = FakeClock()
    serving = {"now": True}
    worker = component(tmp_path, started, SLEEPER, ready=lambda: serving["now"])
    supervisor = Supervisor([worker], backoff=BACKOFF, clock=clock, start_timeout_s=20.0)

    def no_binary() -> ManagedProcess:
        raise FileNotFoundError("no such file: /nowhere/envoy")

    worker.spawn = no_binary
    worker.proc.popen.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    assert isinstance(poll_until(supervisor, Exit), Exit)
    [failed] = supervisor.poll()  # restart at once: fails to start
    assert isinstance(failed, Exit)
    assert failed.status.startswith("could not start: no such file")
    assert failed.restart_in_s == 0.5 and worker.restarts == 1

    worker.spawn = lambda: _start(tmp_path, started, SLEEPER)
    serving["now"] = False
    clock.now += 0.5
    assert supervisor.poll() == [] and worker.state is State.STARTING
    stuck = worker.proc
    clock.now += 20.5
    [timed_out] = supervisor.poll()
    assert isinstance(timed_out, Exit)
    assert timed_out.status == "not serving 20 s after start" and timed_out.restart_in_s == 1.0
    assert not stuck.alive()  # killed, not left running beside its replacement


def test_the_report_is_bounded_and_parses_back(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    worker = component(tmp_path, started, CRASHER)
    supervisor = Supervisor([worker], backoff=Backoff(initial_s=0.01, max_s=0.01))
    exits = 0
    deadline = time.monotonic() + 60
    while exits < 25 and time.monotonic() < deadline:
        exits += sum(isinstance(e, Exit) for e in supervisor.poll())
        time.sleep(0.005)
    report = supervisor.report()
    assert len(report.events) == 20
    doc = json.loads(report.to_json())
    assert doc["components"][0]["restarts"] == worker.restarts >= 24
    with pytest.raises(ValueError, match="not a supervision report"):
        SupervisionReport.from_json('{"components": []}')
