"""Wait for a condition, never for a fixed time: the suite's one way to synchronise.

A test that sleeps "long enough" either wastes the time or, on a busy 2-core machine,
fails; a test that asserts "within N seconds" measures the machine. Both poll the
condition here instead, with a deadline generous enough that only a real failure
reaches it, and assert what happened. Figures (how long it took) belong in
bench/scripts/, not in a test's assertions.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

TRANSIENT: tuple[type[BaseException], ...] = (OSError, KeyError, ValueError, IndexError)
"""Errors a probe may raise while the thing it reads is still coming up (a port not
listening yet, a key not there yet, a half-written file): polled through, not failed on."""


def wait_until(
    check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02
) -> float:
    """Poll ``check()`` until it returns something truthy; the seconds it took.

    Fails with ``what`` after ``timeout`` seconds; the last transient error, if any, is
    chained so a probe that never worked says why.
    """
    started = time.monotonic()
    last: BaseException | None = None
    while True:
        try:
            if check():
                return time.monotonic() - started
        except TRANSIENT as exc:
            last = exc
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}") from last
        time.sleep(interval)


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``check()`` until it returns something truthy, and return that value."""
    got: list[T] = []

    def probe() -> bool:
        value = check()
        if value:
            got.append(value)
            return True
        return False

    wait_until(probe, timeout, what, interval)
    return got[-1]


async def async_wait_until(
    check: Callable[[], Any | Awaitable[Any]],
    timeout: float,
    what: str,
    interval: float = 0.01,
) -> float:
    """:func:`wait_until` on an event loop: ``check`` may be a coroutine function.

    The loop keeps running between probes, so the code under test (on the same loop)
    makes progress while the test waits.
    """
    started = time.monotonic()
    last: BaseException | None = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return time.monotonic() - started
        except TRANSIENT as exc:
            last = exc
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}") from last
        await asyncio.sleep(interval)
