"""What one peer may cost ext_proc's HTTP/2 server, and what happens when it asks for more.

Every limit is a field of :class:`PeerLimits` with a safe default, and a flag of
``prefix-router ext-proc`` (``--h2-<field name with dashes>``, see :func:`add_flags`).
The message size limit and the partial-message budgets follow the largest request
body Envoy is configured to pass (``--max-body-bytes``, the bootstrap's own
``max_body_bytes``): Envoy sends a buffered body as one gRPC message.

A breach is counted (``prefix_router_ext_proc_http2_limit_breaches{limit}``) and
logged at most once per peer address and limit a minute (:class:`BreachReporter`):
a flood must not turn into a flood of log lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("prefix_router.ext_proc.http2")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""The largest request body Envoy passes by default (``BootstrapParams.max_body_bytes``)."""
MESSAGE_OVERHEAD_BYTES = 64 * 1024
"""Room for the ProcessingRequest around a body (its fields, headers, trailers)."""
FD_RESERVE = 128
"""File descriptors kept free of peer connections: Redis, metrics, logs, the listener."""


def default_max_connections() -> int:
    """Peer connections one process accepts: its open-file limit less :data:`FD_RESERVE`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 100_000
    return max(16, soft - FD_RESERVE)


def _limit(help_text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerLimits:
    """Limits on every peer of the HTTP/2 server; all sizes in bytes, times in seconds."""

    max_concurrent_streams: int = _limit(
        "streams one connection may have open (advertised; Envoy opens another connection "
        "when it reaches it; more are refused with RST_STREAM)",
        1_000,
    )
    max_open_calls: int = _limit(
        "streams open on all connections of the process (each a request Envoy has in "
        "flight, ~1.4 KB); one more is refused with RST_STREAM REFUSED_STREAM (Envoy goes on "
        "without routing it). At least the ext_proc cluster's circuit breaker (max_requests, "
        "100,000 by default), which already bounds Envoy's streams",
        100_000,
    )
    stream_window: int = _limit(
        "receive window of each stream, returned as the gRPC layer takes messages", 1 << 20
    )
    connection_window: int = _limit(
        "receive window of each connection, returned as the gRPC layer takes messages",
        16 << 20,
    )
    max_frame_size: int = _limit("largest frame payload accepted (advertised)", 1 << 20)
    max_message_bytes: int = _limit(
        "largest gRPC request message (default: the body limit and its envelope)",
        DEFAULT_MAX_BODY_BYTES + MESSAGE_OVERHEAD_BYTES,
    )
    connection_partial_bytes: int = _limit(
        "bytes of unfinished request messages one connection may hold (default: two messages)",
        2 * (DEFAULT_MAX_BODY_BYTES + MESSAGE_OVERHEAD_BYTES),
    )
    process_partial_bytes: int = _limit(
        "bytes of unfinished request messages all connections may hold (default: four messages)",
        4 * (DEFAULT_MAX_BODY_BYTES + MESSAGE_OVERHEAD_BYTES),
    )
    partial_message_timeout: float = _limit(
        "a stream whose unfinished message makes no progress this long is reset", 30.0
    )
    first_message_timeout: float = _limit(
        "a stream that has sent no byte of a message this long after it opened is reset "
        "(Envoy sends its first message at once)",
        10.0,
    )
    max_header_list_size: int = _limit("decoded size of one header block", 64 * 1024)
    max_header_fields: int = _limit("fields in one header block", 128)
    max_continuations: int = _limit("CONTINUATION frames after one HEADERS frame", 8)
    max_settings_entries: int = _limit("entries in one SETTINGS frame", 32)
    max_queued_acks: int = _limit("SETTINGS and PING acknowledgements queued unsent", 1_000)
    reset_burst: int = _limit(
        "streams the peer may reset before their call ended, in a burst (with Envoy's "
        "graceful close, our bootstrap's, only a client abort resets a stream; an Envoy "
        "without it resets every one and needs a rate above its requests/s)",
        1_000,
    )
    reset_rate: float = _limit("... and per second after the burst", 200.0)
    glitch_burst: int = _limit(
        "empty or useless frames (empty DATA, frames on closed streams ...) in a burst",
        10_000,
    )
    glitch_rate: int = _limit("... and per second after the burst", 330)
    handshake_timeout: float = _limit("time to send the connection preface and SETTINGS", 10.0)
    idle_timeout: float = _limit(
        "a connection with no open stream and no frame this long is closed (GOAWAY)", 300.0
    )
    write_stall_timeout: float = _limit(
        "a peer that reads nothing of what we send this long is disconnected", 30.0
    )
    max_queued_output: int = _limit(
        "bytes of answers waiting for the peer's windows; past it, the peer has "
        "write_stall_timeout to open them",
        4 << 20,
    )
    max_connections: int = _limit(
        "peer connections one process accepts (default: the open-file limit less 128)", 0
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value < 0 or (value == 0 and f.name != "max_connections"):
                raise ValueError(f"{f.name} must be positive, not {value}")
        if self.max_connections == 0:
            object.__setattr__(self, "max_connections", default_max_connections())
        if not 16_384 <= self.max_frame_size < 1 << 24:
            raise ValueError("max_frame_size must be within [16384, 2^24-1]")
        if self.connection_partial_bytes > self.process_partial_bytes:
            raise ValueError("connection_partial_bytes exceeds process_partial_bytes")

    @classmethod
    def for_body_limit(cls, max_body_bytes: int, **overrides: Any) -> PeerLimits:
        """Limits whose message size and budgets follow Envoy's body limit."""
        message = max_body_bytes + MESSAGE_OVERHEAD_BYTES
        sized: dict[str, Any] = {
            "max_message_bytes": message,
            "connection_partial_bytes": 2 * message,
            "process_partial_bytes": 4 * message,
        }
        return cls(**{**sized, **overrides})


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-body-bytes`` and one ``--h2-...`` flag per :class:`PeerLimits` field."""
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="the largest request body Envoy passes (its bootstrap's max_body_bytes): sizes "
        "the message limit and the partial-message budgets",
    )
    group = parser.add_argument_group(
        "limits on every peer (--transport http2; grpcio takes those it has a setting for)"
    )
    for f in dataclasses.fields(PeerLimits):
        group.add_argument(
            f"--h2-{f.name.replace('_', '-')}",
            dest=f"h2_{f.name}",
            type=type(f.default),
            default=None,
            help=f"{f.metadata['help']}" + (f" (default {f.default})" if f.default else ""),
        )


def limits_from_args(args: argparse.Namespace) -> PeerLimits:
    overrides = {
        f.name: getattr(args, f"h2_{f.name}")
        for f in dataclasses.fields(PeerLimits)
        if getattr(args, f"h2_{f.name}", None) is not None
    }
    return PeerLimits.for_body_limit(args.max_body_bytes, **overrides)


class TokenBucket:
    """``burst`` events at once, then ``rate`` a second: :meth:`take` is False past that."""

    __slots__ = ("_burst", "_rate", "_tokens", "_at")

    def __init__(self, burst: int, rate: float, now: float) -> None:
        self._burst, self._rate = float(burst), rate
        self._tokens, self._at = float(burst), now

    def take(self, now: float) -> bool:
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


LOG_INTERVAL = 60.0
"""A peer's breach of one limit is logged at most this often."""
_REMEMBERED = 10_000


class BreachReporter:
    """Counts every breach (``count(limit)``), logs one per peer and limit a minute."""

    def __init__(
        self,
        count: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._count = count
        self._clock = clock
        self._logged: dict[tuple[str, str], float] = {}
        self.totals: dict[str, int] = {}

    def breach(self, limit: str, peer: str, detail: str = "", *, quiet: bool = False) -> None:
        """Count it; log it unless ``quiet`` or this peer's breach of it was logged lately."""
        self.totals[limit] = self.totals.get(limit, 0) + 1
        if self._count is not None:
            self._count(limit)
        if quiet:
            return
        now = self._clock()
        key = (peer, limit)
        last = self._logged.get(key)
        if last is not None and now - last < LOG_INTERVAL:
            return
        if len(self._logged) >= _REMEMBERED:
            self._logged = {k: t for k, t in self._logged.items() if now - t < LOG_INTERVAL}
        self._logged[key] = now
        log.warning(
            "HTTP/2 peer %s breached the %s limit%s (logged once a minute per peer and limit)",
            peer,
            limit,
            f": {detail}" if detail else "",
            extra={"limit": limit, "peer": peer},
        )


class PartialBudget:
    """Bytes of unfinished request messages held by all of a server's connections."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
