"""``prefix-router envoy-drain`` (Envoy's preStop hook) against a real Envoy: it returns once
the requests open on the data plane have finished, not after a fixed sleep that cut the
generations still streaming."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.drain_cli import ACTIVE_STAT, drain, open_requests
from prefix_router.ops.launch import start_envoy
from prefix_router.ops.procs import free_port
from tests.conftest import ProcessReaper
from tests.support.streaming_backend import LAST_CHUNK, streaming_backend
from tests.support.uvicorn_server import uvicorn_serving

STREAM_S = 3.0


@pytest.mark.e2e
async def test_the_drain_waits_for_the_streams_open_and_no_longer(
    procs: ProcessReaper, log_dir: Path
) -> None:
    backend = free_port()
    config = streaming_backend(backend, seconds=STREAM_S)
    params = BootstrapParams(listen_port=free_port(), admin_port=free_port(), ext_proc=())
    fleet = Fleet.of([Instance("127.0.0.1", backend)])
    envoy = procs.add(start_envoy(params, RouterConfig(), log_dir, fleet=fleet))
    admin = f"127.0.0.1:{params.admin_port}"
    url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
    async with uvicorn_serving(config), httpx.AsyncClient(timeout=30) as client:

        async def stream() -> bytes:
            async with client.stream("POST", url, json={"model": "m", "stream": True}) as r:
                assert r.status_code == 200
                return b"".join([chunk async for chunk in r.aiter_bytes()])

        generation = asyncio.create_task(stream())
        deadline = time.monotonic() + 10
        while not await asyncio.to_thread(open_requests, admin):
            assert time.monotonic() < deadline, "Envoy never counted the stream as open"
            await asyncio.sleep(0.05)
        left = await asyncio.to_thread(drain, admin, timeout_s=30, settle_s=0.2, poll_s=0.1)
        assert left == 0
        assert generation.done(), "the drain returned while the stream was still open"
        assert (await generation).endswith(LAST_CHUNK)  # whole: nothing was cut

    # with nothing open, it returns once the settle time is over
    started = time.monotonic()
    assert await asyncio.to_thread(drain, admin, timeout_s=30, settle_s=0.2, poll_s=0.1) == 0
    assert time.monotonic() - started < 5
    envoy.stop()
    assert drain(admin, timeout_s=1, settle_s=0) is None  # no Envoy: nothing to wait for


class _FlakyAdmin(BaseHTTPRequestHandler):
    """Envoy's admin as a drain sees it: the drain accepted; the open-request count first
    not answered (the connection dropped), then 1, then 0."""

    answers: list[int | None] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        value = self.answers.pop(0) if self.answers else 0
        if value is None:
            self.close_connection = True  # no answer at all: the client sees it dropped
            return
        body = json.dumps({"stats": [{"name": ACTIVE_STAT, "value": value}]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.parametrize(("envoy_runs", "expected"), [(True, 0), (False, None)])
def test_a_missed_answer_ends_the_wait_only_once_envoy_is_gone(
    envoy_runs: bool, expected: int | None
) -> None:
    _FlakyAdmin.answers = [None, 1, 0]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FlakyAdmin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        admin = f"127.0.0.1:{server.server_address[1]}"
        left = drain(admin, timeout_s=30, settle_s=0, poll_s=0.01, alive=lambda: envoy_runs)
        assert left == expected
        assert _FlakyAdmin.answers == ([] if envoy_runs else [1, 0])
    finally:
        server.shutdown()
        server.server_close()
