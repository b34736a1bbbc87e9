"""``prefix-router envoy-run`` (how compose runs Envoy) against a real Envoy: a SIGTERM to it,
as ``docker compose down`` sends one to the container's first process, lets the streams
open finish before Envoy stops; a second SIGTERM stops it at once; Envoy's own exit
status comes through."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.drain_cli import open_requests
from prefix_router.ops.launch import envoy_live, start_envoy
from prefix_router.ops.procs import ManagedProcess, cli_command, free_port
from tests.conftest import ProcessReaper
from tests.support.streaming_backend import LAST_CHUNK, streaming_backend
from tests.support.uvicorn_server import uvicorn_serving

STREAM_S = 3.0


def _envoy_run(admin_port: int) -> list[str]:
    return cli_command("envoy-run", f"--admin=127.0.0.1:{admin_port}", "--settle=0.2", "--")


async def _exit_of(proc: ManagedProcess, within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while proc.popen is not None and proc.popen.poll() is None:
        assert time.monotonic() < deadline, f"envoy-run still running:\n{proc.tail()}"
        await asyncio.sleep(0.05)
    assert proc.popen is not None and proc.popen.returncode is not None
    return proc.popen.returncode


@pytest.mark.e2e
@pytest.mark.parametrize("second_sigterm", [False, True], ids=["drained", "second-sigterm"])
async def test_sigterm_lets_open_streams_finish_and_a_second_one_stops_envoy_at_once(
    procs: ProcessReaper, log_dir: Path, second_sigterm: bool
) -> None:
    backend = free_port()
    params = BootstrapParams(listen_port=free_port(), admin_port=free_port(), ext_proc=())
    fleet = Fleet.of([Instance("127.0.0.1", backend)])
    proc = procs.add(
        start_envoy(
            params, RouterConfig(), log_dir, fleet=fleet, under=_envoy_run(params.admin_port)
        )
    )
    admin = f"127.0.0.1:{params.admin_port}"
    url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
    # cut at once: a stream long enough that stopping within a few seconds is not its end
    config = streaming_backend(backend, seconds=3 * STREAM_S if second_sigterm else STREAM_S)
    async with uvicorn_serving(config), httpx.AsyncClient(timeout=30) as client:

        async def stream() -> bytes:
            body = b""
            try:
                async with client.stream("POST", url, json={"model": "m", "stream": True}) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        body += chunk
            except httpx.HTTPError:
                pass  # cut: what was received is returned
            return body

        generation = asyncio.create_task(stream())
        deadline = time.monotonic() + 10
        while not await asyncio.to_thread(open_requests, admin):
            assert time.monotonic() < deadline, "Envoy never counted the stream as open"
            await asyncio.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)  # the wrapper alone, as docker signals PID 1
        if second_sigterm:
            await asyncio.sleep(0.5)
            os.kill(proc.pid, signal.SIGTERM)
            code = await _exit_of(proc, within_s=5)
            assert not (await generation).endswith(LAST_CHUNK)  # cut, as asked
        else:
            code = await _exit_of(proc, within_s=STREAM_S + 20)
            assert generation.done(), "Envoy stopped while the stream was still open"
            assert (await generation).endswith(LAST_CHUNK)  # whole: nothing was cut
        assert code == 0, proc.tail()
    assert not envoy_live(params.admin_port)  # Envoy went with it


@pytest.mark.parametrize(
    ("script", "expected"),
    [("exit 3", 3), ("exit 0", 0), ("kill -KILL $$", 128 + signal.SIGKILL)],
)
def test_envoys_own_exit_status_is_envoy_runs(script: str, expected: int) -> None:
    done = subprocess.run(
        [*cli_command("envoy-run", "--"), "sh", "-c", script], timeout=30, capture_output=True
    )
    assert done.returncode == expected


def test_without_a_command_it_says_how_to_give_one() -> None:
    done = subprocess.run(
        cli_command("envoy-run"), timeout=30, capture_output=True, text=True, check=False
    )
    assert done.returncode == 2
    assert "no command to run" in done.stderr
