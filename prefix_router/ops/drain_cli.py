"""``prefix-router envoy-drain``: let Envoy's open requests finish before it is stopped.

Kubernetes runs it as Envoy's ``preStop`` hook and sends SIGTERM when it returns (or when
the pod's grace period ends), and Envoy exits on SIGTERM at once, cutting every stream
still open. So the hook drains the data plane (``POST /drain_listeners?graceful&inboundonly``:
new connections go to other pods, the probe listener keeps answering) and returns only once
no request is open on it, or at ``--timeout``. A fixed sleep cut every generation still
streaming when it ended, and made a pod with nothing in flight wait for nothing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

ACTIVE_STAT = "http.data_plane.downstream_rq_active"
"""Requests open on the data-plane listener (its stat prefix is ``data_plane``)."""


def open_requests(admin: str, timeout: float = 2.0) -> int | None:
    """Requests open on Envoy's data plane now; None if its admin does not answer."""
    query = urllib.parse.urlencode({"format": "json", "filter": f"^{ACTIVE_STAT}$"})
    try:
        with urllib.request.urlopen(f"http://{admin}/stats?{query}", timeout=timeout) as r:
            stats = json.load(r)["stats"]
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return None
    return sum(int(s.get("value", 0)) for s in stats if s.get("name") == ACTIVE_STAT)


def drain(
    admin: str,
    *,
    timeout_s: float,
    settle_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    alive: Callable[[], bool] | None = None,
) -> int | None:
    """Drain Envoy's data plane, then wait until no request is open on it (at least
    ``settle_s``, while the pod leaves the Service's endpoints; at most ``timeout_s``).
    Returns the requests still open when it stopped waiting (None: Envoy's admin did not
    answer, so there is nothing to wait for). With ``alive`` (whether Envoy still runs),
    an admin that misses one answer is asked again while Envoy runs: a slow answer is no
    reason to cut every stream."""
    deadline = clock() + timeout_s
    drained = start_draining(admin)
    if not drained and (alive is None or not alive()):
        return None
    sleep(min(settle_s, timeout_s))
    while True:
        drained = drained or start_draining(admin)
        left = open_requests(admin)
        unanswered = left is None and alive is not None and alive()
        if (not left and not unanswered) or clock() >= deadline:
            return left
        sleep(min(poll_s, max(0.0, deadline - clock())))


def start_draining(admin: str) -> bool:
    """Ask Envoy to drain its data plane; whether it answered."""
    request = urllib.request.Request(
        f"http://{admin}/drain_listeners?graceful&inboundonly", method="POST"
    )
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except (OSError, http.client.HTTPException):
        return False
    return True


def add_drain_options(
    parser: argparse.ArgumentParser, *, grace: str, settle_s: float, settle_help: str
) -> None:
    """A drain's options: Envoy's admin, and the longest and shortest wait (``--timeout``
    below ``grace``, what kills Envoy if it is still running then)."""
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin HOST:PORT")
    parser.add_argument(
        "--timeout",
        type=float,
        default=590.0,
        help=f"stop waiting for open requests after this many seconds (below {grace})",
    )
    parser.add_argument("--settle", type=float, default=settle_s, help=settle_help)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefix-router envoy-drain", description=__doc__)
    add_drain_options(
        p,
        grace="the pod's grace period",
        settle_s=5.0,
        settle_help="wait at least this long: the pod leaves the Service's endpoints meanwhile",
    )
    args = p.parse_args(argv)
    left = drain(args.admin, timeout_s=args.timeout, settle_s=args.settle)
    if left is None:
        print("envoy-drain: Envoy's admin does not answer: nothing to drain", file=sys.stderr)
    elif left:
        print(f"envoy-drain: {left} requests still open at the timeout", file=sys.stderr)
    return 0
