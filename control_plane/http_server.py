"""The control plane's HTTP servers (admin API, metrics): uvicorn, with a deadline on each
request's head.

uvicorn bounds a request head's size (h11: 16 KiB) but not its time: nothing times a
connection out before its first request, and once a byte of a head has arrived nothing
does until the request is answered. So any peer that reaches the port could hold
connections (and the process's file descriptors) for good by saying nothing, or by
sending a head a byte at a time. :class:`HeadTimeoutH11Protocol` gives every request's
head a deadline, ``head_timeout_s`` from the connection's opening or the previous
response's end: a head not complete by then closes the connection. Bodies have their own
bound (:mod:`control_plane.body_limit`); between requests uvicorn's keep-alive timeout
(5 s) still applies.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0
"""Seconds a peer has to send a request's head (from its connection, or the end of the
previous response on the connection)."""


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head (module docstring).

    The deadline uses uvicorn's keep-alive timer slot: uvicorn cancels that timer on
    every read, and this class arms it again, for the time left, while the head is
    incomplete; uvicorn's own handler closes the connection when it fires."""

    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = self.loop.time() + self.head_timeout_s
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # the head is not complete yet
            self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next head is due within the keep-alive timeout uvicorn has just armed
        self._head_deadline = self.loop.time() + self.timeout_keep_alive

    def _arm_head_deadline(self) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_at(
            self._head_deadline, self.timeout_keep_alive_handler
        )


def server_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """The uvicorn config of one of the control plane's HTTP ports: ``app`` on
    ``host:port``, with :class:`HeadTimeoutH11Protocol`; logging and lifespan are the
    process's own."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=HeadTimeoutH11Protocol,
        log_level="warning",
        log_config=None,
        lifespan="off",
    )
