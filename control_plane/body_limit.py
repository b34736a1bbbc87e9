"""A bound on what one admin API request may make the control plane read.

FastAPI reads a request's body before it runs the route's dependencies, the bearer-token
check among them, so without a bound any peer that reaches the admin port could make the
control plane hold a body of any size, or hold a connection open by sending one slowly,
before being told 401. :class:`BodyLimit` sits in front of the app (ASGI middleware):

* a declared ``Content-Length`` over ``max_bytes`` is answered 413 before a byte of the
  body is read; one that is not a number, 400;
* a body without a declared length (chunked) is counted as it arrives and answered 413
  once it passes ``max_bytes``;
* each read of the body must arrive within ``read_timeout_s``, else 408.

The admin API's bodies are small (a whole RouterConfig is a few KB, an instance a few
hundred bytes), so the default bound of 1 MiB refuses nothing real.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 1 << 20
"""The largest admin API request body read (1 MiB)."""
READ_TIMEOUT_S = 10.0
"""Seconds one read of a request's body may take."""


class _Refused(Exception):
    """A request refused: its status and the reason, as the answer's ``detail``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class BodyLimit:
    """ASGI middleware: see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = MAX_BODY_BYTES,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_declared(scope)
        except _Refused as breach:
            await _refuse(send, breach)
            return
        received = 0
        started = answered = False

        async def bounded_receive() -> Message:
            nonlocal received, started, answered
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                breach = _Refused(408, "the request body arrived too slowly")
            else:
                if message["type"] != "http.request":
                    return message
                received += len(message.get("body", b""))
                if received <= self.max_bytes:
                    return message
                breach = _Refused(413, f"request body over {self.max_bytes} bytes")
            # Answer here: the app would turn any error of its body read into its own 400.
            # It then sees the client gone, and whatever it answers is dropped.
            if not started:
                started = answered = True
                await _refuse(send, breach)
            return {"type": "http.disconnect"}

        async def watched_send(message: Message) -> None:
            nonlocal started
            if answered:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, watched_send)
        except Exception:
            if not answered:
                raise

    def _check_declared(self, scope: Scope) -> None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise _Refused(400, "Content-Length is not a number") from None
                if length > self.max_bytes:
                    raise _Refused(413, f"request body over {self.max_bytes} bytes")


async def _refuse(send: Send, refused: _Refused) -> None:
    """Answer ``refused`` as the admin API answers errors (``{"detail": ...}``) and close
    the connection: the rest of the body is never read."""
    body = json.dumps({"detail": refused.detail}).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
