"""Processes a test starts outside the ``procs`` reaper, stopped on every path, whole groups.

:class:`UpProcess` is ``prefix-router up`` run as a user runs it: a child process in
its own session. ``up`` starts each component in a session of its own, so stopping ``up``'s group
does not reach them when ``up`` itself misbehaves (hangs, dies, regresses). This
helper remembers every process of the tree it has seen (PID and start time, so a
reused PID is never taken for one of ours) and, on every path out of its ``with``
block, stops ``up`` (SIGTERM, then SIGKILL to its group) and then kills whatever
of the remembered processes is still running, each with its whole group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

Known = dict[int, float]
"""PID -> process start time."""


def _tree(pid: int) -> Known:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    known: Known = {}
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            known[proc.pid] = proc.create_time()
    return known


def _still_ours(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return bool(proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


class UpProcess:
    """One ``prefix-router up ARGS``; its output goes to ``out``."""

    def __init__(self, args: Sequence[str], out: Path, *, env: dict[str, str] | None = None):
        self.argv = [sys.executable, "-m", "prefix_router", "up", *args]
        self.out = out
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None
        self.known: Known = {}

    def start(self) -> UpProcess:
        with self.out.open("ab") as sink:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def track(self) -> Known:
        """Remember every process of ``up``'s tree now; returns the tree."""
        tree = _tree(self.pid)
        self.known.update(tree)
        return tree

    def wait_up(self, timeout: float = 120.0) -> str:
        """Wait for the banner; returns it. Fails at once if ``up`` exits first."""
        assert self.popen is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.track()
            text = self.output()
            if "Ctrl-C stops everything." in text:
                return text
            assert self.popen.poll() is None, text
            time.sleep(0.1)
        raise AssertionError(f"up not ready in {timeout} s:\n{self.output()}")

    def wait(self, timeout: float) -> int:
        """Wait for ``up`` to exit by itself (tracking its tree meanwhile)."""
        assert self.popen is not None
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None and time.monotonic() < deadline:
            self.track()
            time.sleep(0.05)
        return self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, as Ctrl-C would; returns ``up``'s exit code."""
        assert self.popen is not None
        self.track()
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout=timeout)

    def leftovers(self) -> list[int]:
        """Processes of ``up``'s tree still running (``up`` itself excluded)."""
        return [
            pid
            for pid, created in self.known.items()
            if pid != self.pid and _still_ours(pid, created)
        ]

    def kill_all(self) -> None:
        """Stop ``up`` and everything of its tree, each process's whole group."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.track()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
        kill_with_groups(self.leftovers())  # also when it had exited and left them running

    def __enter__(self) -> UpProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill_all()


@contextlib.contextmanager
def up_process(
    args: Sequence[str], out: Path, *, env: dict[str, str] | None = None
) -> Iterator[UpProcess]:
    with UpProcess(args, out, env=env) as up:
        yield up


def run_up(args: Sequence[str], out: Path, *, timeout: float = 60.0) -> tuple[int, str]:
    """``up`` expected to exit by itself (a refused start): its exit code and output.
    Whatever it started is stopped on every path, also if it did not exit."""
    with UpProcess(args, out) as up:
        code = up.wait(timeout)
        return code, up.output()


def banner_value(banner: str, label: str) -> str:
    """The value after ``label`` on the banner line that starts with it."""
    match = re.search(rf"^\s+{re.escape(label)}\s+(\S+)", banner, flags=re.M)
    assert match is not None, (label, banner)
    return match.group(1)


def clean_env() -> dict[str, str]:
    """This environment without ``REDIS_URL`` and ``PREFIX_ROUTER_*``: up's own defaults."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != "REDIS_URL" and not k.startswith("PREFIX_ROUTER")
    }


def run_group(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` whose child gets a process group of its own, killed whole on every
    path (``subprocess.run`` kills only the child on a timeout: ``bash -c curl`` would leave
    the curl running)."""
    with subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the leader is not reaped yet here
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def children() -> Known:
    """Every descendant of this (the test's) process now."""
    tree = _tree(os.getpid())
    tree.pop(os.getpid(), None)
    return tree


def new_since(before: Known) -> list[int]:
    """Descendants running now that were not in ``before`` (started since)."""
    return [
        pid
        for pid, created in children().items()
        if before.get(pid) != created and _still_ours(pid, created)
    ]


def kill_with_groups(pids: Sequence[int]) -> None:
    """SIGKILL each process, with its whole group where it leads one (never the test's own)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid and pid != os.getpgrp():
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
