"""ext_proc's /metrics endpoint holds at most a few connections, each for a bounded time,
so a peer reaching the metrics port cannot take the process's threads or the file
descriptors its gRPC server needs (prometheus_client's own server held one thread and
one descriptor per idle connection, forever)."""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, generate_latest

from ext_proc.metrics_server import serve_metrics
from prefix_router.ops.launch import start_ext_proc
from prefix_router.ops.procs import free_port
from tests.support.wait import wait_until

WAIT_S = 3.0


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True if the server closes ``sock`` within ``within_s`` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@contextmanager
def idle_connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    with ExitStack() as stack:
        socks = []
        for _ in range(count):
            socks.append(stack.enter_context(socket.create_connection(("127.0.0.1", port))))
        yield socks


def scrape_text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as r:
        return r.read().decode()


def scrape_or_nothing(port: int) -> str:
    try:
        return scrape(port)
    except OSError:  # refused while the slots are still taken
        return ""


def test_idle_connections_are_capped_then_timed_out_and_scrapes_resume() -> None:
    registry = CollectorRegistry()
    Counter("probe_total", "a metric to find", registry=registry).inc()
    refused = Counter("refused_total", "connections refused", registry=registry)
    # the cap, with a timeout no slow machine reaches: 6 of 10 closed as accepted, counted
    port = free_port()
    server = serve_metrics(
        port, "127.0.0.1", registry, max_connections=4, timeout_s=60, on_refused=refused.inc
    )
    threads_before = threading.active_count()
    try:
        with idle_connections(port, 10) as socks:
            wait_until(lambda: "refused_total 6.0" in scrape_text(registry), 10, "6 refused")
            closed = [s for s in socks if closed_by_server(s, 0.2)]
            assert len(closed) == 6
            assert threading.active_count() <= threads_before + 4
        # once the server has seen the idle ones go (each slot's thread ends), it serves
        wait_until(lambda: "probe_total 1.0" in scrape_or_nothing(port), 10, "a scrape")
    finally:
        server.shutdown()
        server.server_close()
    # the timeout: connections that send nothing are closed, and scrapes go on
    port = free_port()
    server = serve_metrics(port, "127.0.0.1", registry, max_connections=4, timeout_s=0.5)
    threads_before = threading.active_count()
    try:
        with idle_connections(port, 4) as socks:
            assert all(closed_by_server(s, WAIT_S) for s in socks)  # silent: timed out
        assert "probe_total 1.0" in scrape(port)
        wait_until(lambda: threading.active_count() <= threads_before, 10, "threads end")
    finally:
        server.shutdown()
        server.server_close()


def test_idle_metrics_connections_do_not_take_ext_procs_descriptors(tmp_path: Path) -> None:
    grpc_port, metrics_port = free_port(), free_port()
    proc = start_ext_proc(
        grpc_port,
        tmp_path,
        args=["--backend", "127.0.0.1:9", "--metrics-port", str(metrics_port)],
    )
    try:
        assert "prefix_router_ext_proc" in scrape(metrics_port)
        fds_before = len(os.listdir(f"/proc/{proc.pid}/fd"))
        with idle_connections(metrics_port, 200) as socks:
            closed: set[int] = set()

            def refused_all_but_8() -> bool:
                closed.update(i for i, s in enumerate(socks) if closed_by_server(s, 0.01))
                return len(closed) >= 192

            wait_until(refused_all_but_8, 30, "192 connections closed as accepted")
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= fds_before + 8
        # A scrape sent before the server has seen the 8 idle sockets close is refused
        # too, and counted: the total is 192 plus the scrapes refused meanwhile.
        scrapes_refused = 0

        def refusals_counted() -> bool:
            nonlocal scrapes_refused
            try:
                text = scrape(metrics_port)
            except ConnectionResetError:  # http.client.RemoteDisconnected: closed unanswered
                scrapes_refused += 1
                return False
            total = 192 + scrapes_refused
            return f"prefix_router_ext_proc_metrics_connections_refused_total {total}.0" in text

        wait_until(refusals_counted, 10, "the refusals counted")
    finally:
        proc.stop()


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_the_connections_deadline() -> None:
    """Each byte within the read timeout, the request never complete: the connection is
    closed ``timeout_s`` after it was accepted, so such peers cannot hold every slot."""
    registry = CollectorRegistry()
    Counter("probe_total", "a metric to find", registry=registry).inc()
    port = free_port()
    server = serve_metrics(port, "127.0.0.1", registry, max_connections=1, timeout_s=0.5)
    stop = threading.Event()
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:

            def trickle() -> None:
                for byte in b"GET /metrics HTTP/1.1\r\nx-padding: " + b"a" * 500:
                    if stop.wait(0.1):
                        return
                    try:
                        sock.sendall(bytes([byte]))
                    except OSError:
                        return

            dripping = threading.Thread(target=trickle)
            dripping.start()
            try:
                assert closed_by_server(sock, WAIT_S)
            finally:
                stop.set()
                dripping.join(5)
        wait_until(lambda: "probe_total" in scrape_or_nothing(port), 10, "the slot free again")
    finally:
        server.shutdown()
        server.server_close()
