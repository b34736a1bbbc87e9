"""The control plane's HTTP servers (admin API, metrics): uvicorn, with a deadline on each
request's head and a cap on connections.

uvicorn bounds a request head's size (h11: 16 KiB) but not its time: nothing times a
connection out before its first request, and once a byte of a head has arrived nothing
does until the request is answered. So any peer that reaches the port could hold
connections (and the process's file descriptors) for good by saying nothing, or by
sending a head a byte at a time. :class:`HeadTimeoutH11Protocol` gives every request's
head a deadline, ``head_timeout_s`` from the connection's opening or the previous
response's end: a head not complete by then closes the connection. A body, once its head
is in, has ``body_timeout_s`` to arrive in full, however it trickles (each read's own bound,
:mod:`control_plane.body_limit`, is no bound on the whole, and an app that answers without
reading the body, as the metrics port's do, never reads at all); a connection whose body is
late is closed. Between requests uvicorn's keep-alive timeout (5 s) still applies.

Nor does uvicorn bound connections: ``limit_concurrency`` counts idle connections too and
answers 503 past it, so a peer holding connections would still lock operators out. Each
port here holds at most ``max_connections`` (``--http-max-connections``); one more evicts,
of the connections waiting for a request head (a silent peer, a head arriving a byte at a
time, a keep-alive connection between requests) or still sending a body its request was
answered without, the one nearest its deadline, so a new
peer always gets in while any connection waits. A
request in progress is never cut: when every connection has one, the new connection is
closed at once. Each breach is counted (``http_limit_breaches_total``, by port and limit)
and logged at most once a minute per port.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("prefix_router.control_plane")

HEAD_TIMEOUT_S = 10.0
"""Seconds a peer has to send a request's head (from its connection, or the end of the
previous response on the connection)."""
BODY_TIMEOUT_S = 10.0
"""Seconds a request's body has to arrive in full once its head has (the admin API's are a
few KB)."""
MAX_CONNECTIONS = 64
"""Connections one HTTP port holds at once (``--http-max-connections``): far more than
operators and Prometheus use, far fewer than the process's file descriptors."""
LOG_INTERVAL_S = 60.0
"""A port logs its breaches at most this often."""

BREACHES: Counter[tuple[str, str]] = Counter()
"""Breaches of this process's HTTP ports' limits, by (port name, limit): ``head_timeout``
(a head not complete by its deadline), ``body_timeout`` (a body not complete by its
deadline), ``max_connections`` (a connection evicted or refused). Exported as
``http_limit_breaches_total`` (:mod:`control_plane.metrics`)."""
_logged_at: dict[str, float] = {}


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head (module docstring).

    The deadline uses uvicorn's keep-alive timer slot: uvicorn cancels that timer on
    every read, and this class arms it again, for the time left, while the head is
    incomplete; uvicorn's own handler closes the connection when it fires."""

    head_timeout_s = HEAD_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    port_name = "http"
    """Names the port in breach counts and logs (``admin``, ``metrics``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = self.loop.time() + self.head_timeout_s
        self._head_started = False
        """Bytes of the awaited head arrived (so the deadline is a breach, not idleness)."""
        self._answered = 0
        self._body_deadline: float | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_of: object = None
        """The request (uvicorn's cycle) whose body the timer is for."""
        if len(self.connections) > self.max_connections and not self._make_room():
            transport.close()
            return
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # the head is not complete yet
            self._stop_body_timer()  # the last body ended in this read (a new cycle began)
            self._head_started = True
            self._arm_head_deadline()
        elif state is h11.SEND_BODY:  # the head is in, the body is arriving
            if self._body_timer is None or self._body_of is not self.cycle:
                # a body begun, or the next request's (the last one ended in this read)
                self._stop_body_timer()
                self._body_of = self.cycle
                self._body_deadline = self.loop.time() + self.body_timeout_s
                self._body_timer = self.loop.call_at(self._body_deadline, self._body_late)
        else:
            self._stop_body_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_body_timer()
        super().connection_lost(exc)

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self._body_deadline = None

    def _body_late(self) -> None:
        """The body's deadline passed. The connection is closed without a word: an answer
        may be on its way out (h11 cannot end the exchange from here), and the app sees
        the client gone."""
        self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._breach("body_timeout")
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._answered += 1
        self._head_started = False
        # the next head is due within the keep-alive timeout uvicorn has just armed
        self._head_deadline = self.loop.time() + self.timeout_keep_alive

    def timeout_keep_alive_handler(self) -> None:
        if self.awaits_head() and (self._answered == 0 or self._head_started):
            self._breach("head_timeout")
        super().timeout_keep_alive_handler()

    def awaits_head(self) -> bool:
        """No request in progress: the connection waits for (the rest of) a head."""
        return self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )

    def answered_but_sending(self) -> bool:
        """The request was answered while its body is still arriving: nobody waits for
        the rest of it."""
        return (
            self.conn.their_state is h11.SEND_BODY
            and self.cycle is not None
            and self.cycle.response_complete
        )

    def _deadline(self) -> float:
        return self._head_deadline if self._body_deadline is None else self._body_deadline

    def _make_room(self) -> bool:
        """Close, of the connections waiting for a head or sending an answered request's
        body, the one nearest its deadline; False: every other connection has a request
        in progress."""
        idle = [
            c
            for c in self.connections
            if c is not self
            and isinstance(c, HeadTimeoutH11Protocol)
            and not c.transport.is_closing()
            and (c.awaits_head() or c.answered_but_sending())
        ]
        self._breach("max_connections")
        if not idle:
            return False
        due_first = min(idle, key=lambda c: c._deadline())
        due_first.transport.close()
        due_first.connections.discard(due_first)  # room now, not when the loop reports it lost
        return True

    def _breach(self, limit: str) -> None:
        BREACHES[self.port_name, limit] += 1
        now = time.monotonic()
        if now - _logged_at.get(self.port_name, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            _logged_at[self.port_name] = now
            counts = {k[1]: v for k, v in BREACHES.items() if k[0] == self.port_name}
            log.warning(
                "%s port: connections over their limits, closed (so far: %s)",
                self.port_name,
                counts,
            )

    def _arm_head_deadline(self) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_at(
            self._head_deadline, self.timeout_keep_alive_handler
        )


def server_config(
    app: Any,
    host: str,
    port: int,
    *,
    name: str = "http",
    max_connections: int = MAX_CONNECTIONS,
) -> uvicorn.Config:
    """The uvicorn config of one of the control plane's HTTP ports: ``app`` on
    ``host:port``, with :class:`HeadTimeoutH11Protocol` holding at most
    ``max_connections``, its breaches counted under ``name``; logging and lifespan are
    the process's own."""
    protocol = type(
        "HeadTimeoutH11Protocol",
        (HeadTimeoutH11Protocol,),
        {"port_name": name, "max_connections": max_connections},
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        log_level="warning",
        log_config=None,
        lifespan="off",
    )
