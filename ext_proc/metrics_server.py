"""ext_proc's ``/metrics`` endpoint, bounded per peer.

prometheus_client's ``start_http_server`` gives each connection a thread that waits for
its request with no time limit: 300 connections that never send one held 300 threads and
300 file descriptors of the ext_proc process, for good (measured). Those descriptors are
the ones the data path's gRPC server needs to accept Envoy's connections, so a peer that
can reach the metrics port could starve the router. This server is the same standard
library pieces (``wsgiref`` serving prometheus_client's WSGI app, a thread a connection)
with two bounds:

* at most ``max_connections`` connections at once; one more is closed as it is accepted
  (counted by ``on_refused``, logged at most once a minute);
* a connection is closed ``timeout_s`` after it was accepted, whatever it sends: a
  request trickled a byte every few seconds (each read within its own timeout) would
  otherwise hold its slot for good, and eight of them every scrape.

A scrape takes a few milliseconds, so the defaults (8 connections, 5 s) refuse nothing a
Prometheus server does.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("prefix_router.ext_proc")

MAX_CONNECTIONS = 8
"""Metrics connections served at once."""
TIMEOUT_S = 5.0
"""Seconds a metrics connection may last (and stay silent)."""
LOG_INTERVAL_S = 60.0
"""Refused connections are logged at most this often."""


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # a scrape every few seconds is not worth a log line


class _BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (5 by default): a burst is closed, not stalled
    slots: threading.BoundedSemaphore
    deadlines: _Deadlines
    max_connections: int
    timeout_s: float
    on_refused: Callable[[], None] | None
    logged_at: float = -LOG_INTERVAL_S

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: close it at once
            self._refused(client_address)
            return
        try:
            request.settimeout(self.timeout_s)
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self.deadlines.watch(request, time.monotonic() + self.timeout_s)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.deadlines.forget(request)
            self.slots.release()

    def _refused(self, client_address: Any) -> None:
        if self.on_refused is not None:
            self.on_refused()
        now = time.monotonic()
        if now - self.logged_at >= LOG_INTERVAL_S:
            self.logged_at = now
            log.warning(
                "metrics port full (%d connections): closed one from %s "
                "(logged at most once a minute)",
                self.max_connections,
                client_address[0],
            )

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that went silent (socket.timeout) or away: nothing to report.
        log.debug("metrics connection from %s ended with an error", client_address, exc_info=True)


class _Deadlines:
    """One thread for every connection's deadline: when it passes, the connection is shut
    down, and its thread's read or write ends at once."""

    def __init__(self) -> None:
        self._due: dict[socket.socket, float] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="metrics-deadlines", daemon=True).start()

    def watch(self, sock: socket.socket, deadline: float) -> None:
        with self._changed:
            self._due[sock] = deadline
            self._changed.notify()

    def forget(self, sock: socket.socket) -> None:
        with self._changed:
            self._due.pop(sock, None)

    def _run(self) -> None:
        while True:
            with self._changed:
                now = time.monotonic()
                late = [s for s, due in self._due.items() if due <= now]
                for sock in late:
                    del self._due[sock]
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                wait = min(self._due.values(), default=now + 60) - now
                self._changed.wait(max(wait, 0.01))


def serve_metrics(
    port: int,
    host: str,
    registry: CollectorRegistry,
    *,
    max_connections: int = MAX_CONNECTIONS,
    timeout_s: float = TIMEOUT_S,
    on_refused: Callable[[], None] | None = None,
) -> WSGIServer:
    """Serve ``registry`` on ``host:port`` (``GET /metrics``, any path) from a daemon
    thread; ``shutdown()`` and ``server_close()`` stop it. ``on_refused`` is called (from
    that thread) for each connection closed because ``max_connections`` were open."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_BoundedServer,), {"address_family": family})
    server: WSGIServer = make_server(
        host, port, make_wsgi_app(registry), server_class=server_class, handler_class=_Handler
    )
    assert isinstance(server, _BoundedServer)
    server.slots = threading.BoundedSemaphore(max_connections)
    server.deadlines = _Deadlines()
    server.max_connections = max_connections
    server.timeout_s = timeout_s
    server.on_refused = on_refused
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
