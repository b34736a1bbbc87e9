"""Child processes: port checks as servers bind, exit statuses, and stopping whole groups."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from prefix_router.ops import procs
from prefix_router.ops.procs import (
    LOWEST_PORT,
    ExitStatus,
    ManagedProcess,
    free_port,
    group_members,
    port_is_free,
    reserve_ports,
    unassigned_ports,
)


def _time_wait_port() -> int:
    """A port whose only socket is a server-side connection in TIME_WAIT (the server closed
    first, as Envoy and uvicorn do with their open connections when they stop)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = int(server.getsockname()[1])
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()
        client.recv(1)  # the server's FIN has arrived: the client can close now
        client.close()
    return port


def test_a_port_in_time_wait_is_free_for_a_server() -> None:
    port = _time_wait_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the old check did: "taken"
    assert port_is_free(port)


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_someone_listens_on_is_taken(reuse_port: bool) -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # as Envoy's listeners do
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert not port_is_free(listener.getsockname()[1])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32768\t60999\n", range(LOWEST_PORT, 32768)),
        ("49152 65535", range(LOWEST_PORT, 49152)),
        ("1024 65535", range(0)),  # the whole range is ephemeral: the kernel picks
        ("", range(LOWEST_PORT, 32768)),  # unreadable: Linux's default
        ("not numbers", range(LOWEST_PORT, 32768)),
    ],
)
def test_ports_handed_out_lie_below_the_ephemeral_range(
    tmp_path: Path, text: str, expected: range
) -> None:
    (tmp_path / "range").write_text(text)
    assert unassigned_ports(tmp_path / "range") == expected
    assert unassigned_ports(tmp_path / "missing") == range(LOWEST_PORT, 32768)


def test_free_ports_are_free_distinct_and_never_a_connections_local_port() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p in unassigned_ports() for p in ports)
    assert all(port_is_free(p) for p in ports[:20])


def test_a_port_in_use_or_handed_out_lately_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    handed_out = free_port()
    with socket.socket() as listener, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))  # any port the kernel says is free, for the third pick
        spare = probe.getsockname()[1]
        probe.close()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        in_use = listener.getsockname()[1]
        picks = iter([in_use, handed_out, spare])
        monkeypatch.setattr(procs, "_pick", SimpleNamespace(choice=lambda _: next(picks)))
        assert free_port() == spare


def test_a_reserved_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """up's fixed ports are free until their process binds them: free_port must not pick
    one for another process meanwhile."""
    with socket.socket() as one, socket.socket() as other:
        one.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        fixed, spare = one.getsockname()[1], other.getsockname()[1]
    monkeypatch.setattr(procs, "_reserved", set())
    picks = iter([fixed, spare])
    monkeypatch.setattr(procs, "_pick", SimpleNamespace(choice=lambda _: next(picks)))
    reserve_ports([fixed])
    assert free_port() == spare


@pytest.mark.parametrize(
    ("status", "text", "returncode"),
    [
        (ExitStatus(code=0), "exit code 0", 0),
        (ExitStatus(code=3), "exit code 3", 3),
        (ExitStatus(signal=signal.SIGKILL), "killed by SIGKILL", -9),
        (
            ExitStatus(signal=signal.SIGSEGV, core_dumped=True),
            "killed by SIGSEGV (core dumped)",
            -11,
        ),
        (ExitStatus(signal=200), "killed by signal 200", -200),
        (ExitStatus.from_returncode(-15), "killed by SIGTERM", -15),
        (ExitStatus.from_returncode(2), "exit code 2", 2),
    ],
)
def test_exit_status_names_the_signal(status: ExitStatus, text: str, returncode: int) -> None:
    assert status.describe() == text
    assert status.returncode == returncode


# A group leader that starts a child in its own group, writes the child's PID, then waits.
# With IGNORE the child ignores SIGTERM (only SIGKILL ends it).
LEADER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""
CHILD = "import time\ntime.sleep(600)"
STUBBORN_CHILD = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)"
)


def _wait_for(path: Path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError(f"nothing in {path}")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # a zombie is gone too
    except OSError:
        return True


@pytest.fixture
def family(tmp_path: Path) -> Iterator[tuple[Path, list[ManagedProcess]]]:
    started: list[ManagedProcess] = []
    try:
        yield tmp_path, started
    finally:
        for proc in started:
            proc.kill()


def _leader(
    tmp_path: Path, child: str, started: list[ManagedProcess]
) -> tuple[ManagedProcess, int]:
    pid_file = tmp_path / f"child-{len(started)}.pid"
    proc = ManagedProcess(
        "leader", [sys.executable, "-c", LEADER, str(pid_file), child], tmp_path / "leader.log"
    ).start()
    started.append(proc)
    return proc, _wait_for(pid_file)


@pytest.mark.parametrize("child", [CHILD, STUBBORN_CHILD], ids=["child", "stubborn-child"])
def test_stop_ends_the_whole_group(family: tuple[Path, list[ManagedProcess]], child: str) -> None:
    tmp_path, started = family
    proc, child_pid = _leader(tmp_path, child, started)
    assert group_members(proc.pid) == {proc.pid, child_pid}
    assert proc.stop(grace=1.0) == -signal.SIGTERM
    assert _gone(child_pid)
    assert group_members(proc.pid) == set()


def test_collect_after_the_leader_died_ends_what_is_left(
    family: tuple[Path, list[ManagedProcess]],
) -> None:
    tmp_path, started = family
    proc, child_pid = _leader(tmp_path, CHILD, started)
    os.kill(proc.pid, signal.SIGKILL)  # a crash of the leader alone
    deadline = time.monotonic() + 30
    while proc.exit_status() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.exit_status() == ExitStatus(signal=signal.SIGKILL)
    assert not proc.alive() and not _gone(child_pid)  # the orphan still runs...
    assert proc.collect() == ExitStatus(signal=signal.SIGKILL)
    assert _gone(child_pid)  # ...until it is collected with its leader
    assert proc.popen is not None and proc.popen.returncode == -signal.SIGKILL


def test_exit_status_does_not_reap(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "short", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "short.log"
    ).start()
    try:
        deadline = time.monotonic() + 30
        while proc.exit_status() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.exit_status() == ExitStatus(code=3)
        assert os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    finally:
        assert proc.stop() == 3
