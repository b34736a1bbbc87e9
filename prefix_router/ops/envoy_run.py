"""``prefix-router envoy-run -- envoy ARGS...``: Envoy, drained before it stops.

Envoy exits at once on SIGTERM, cutting every stream still open, and an LLM's answer can
stream for minutes. Kubernetes gives Envoy a ``preStop`` hook (``envoy-drain``) that drains
it before the SIGTERM; docker compose has no such hook: ``docker compose down`` or
``stop`` sends the container's first process SIGTERM and kills it when the stop grace
period ends. So compose runs Envoy under this command: it starts Envoy as its child and,
on SIGTERM, drains it (:func:`prefix_router.ops.drain_cli.drain`: no new connections, then
wait until no request is open, at most ``--timeout``) before passing the SIGTERM on.
SIGINT, or a second SIGTERM, stops Envoy at once. When Envoy exits by itself, so does this
command, with Envoy's exit status.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from prefix_router.ops.drain_cli import add_drain_options, drain

STOP_WAIT_S = 5.0
"""How long Envoy has to exit after the SIGTERM before it is killed."""


class _StopNow(Exception):
    """A second SIGTERM, or a SIGINT, arrived while draining."""


class _Signals:
    """What was asked of this process, as its signal handlers record it."""

    def __init__(self) -> None:
        self.drain = False
        self.now = False

    def on_term(self, _signum: int, _frame: FrameType | None) -> None:
        if self.drain:
            self.now = True
        self.drain = True

    def on_int(self, _signum: int, _frame: FrameType | None) -> None:
        self.now = True

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that ends early, raising, once Envoy is to stop at once."""
        end = time.monotonic() + seconds
        while not self.now:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))
        raise _StopNow


def run(command: Sequence[str], *, admin: str, timeout_s: float, settle_s: float) -> int:
    """Run ``command`` (Envoy) until it exits, draining it on SIGTERM; its exit status (a
    signal that ended it as 128 + the signal's number, as a shell reports it)."""
    signals = _Signals()
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, signals.on_term),
        signal.SIGINT: signal.signal(signal.SIGINT, signals.on_int),
    }
    try:
        child = subprocess.Popen(list(command))
        try:
            while child.poll() is None and not (signals.drain or signals.now):
                time.sleep(0.05)
            if child.poll() is None and not signals.now:
                left = _drain(signals, child, admin, timeout_s, settle_s)
                if left:
                    print(f"envoy-run: {left} requests still open; stopping", file=sys.stderr)
            if child.poll() is None:
                child.terminate()
            try:
                code = child.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
        except BaseException:
            if child.poll() is None:
                child.kill()
                child.wait()
            raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code if code >= 0 else 128 - code


def _drain(
    signals: _Signals,
    envoy: subprocess.Popen[bytes],
    admin: str,
    timeout_s: float,
    settle_s: float,
) -> int | None:
    try:
        return drain(
            admin,
            timeout_s=timeout_s,
            settle_s=settle_s,
            sleep=signals.sleep,
            alive=lambda: envoy.poll() is None,
        )
    except _StopNow:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="prefix-router envoy-run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_drain_options(
        p,
        grace="the stop grace period",
        settle_s=1.0,
        settle_help="wait at least this long after draining before stopping Envoy",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- envoy ARGS...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to run: prefix-router envoy-run [options] -- envoy ARGS...")
    return run(command, admin=args.admin, timeout_s=args.timeout, settle_s=args.settle)
