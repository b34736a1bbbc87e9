"""A request is in flight from its routing to its response's last byte, through real Envoy.

ext_proc gives a request's count back when Envoy ends its ext_proc stream (see
ext_proc/servicer.py), so this holds only while Envoy keeps the stream open until the
HTTP request ends. An Envoy that closed the stream once it expects no more messages
(after the body, or after the response headers) would fail here: spill would then
count a streaming generation as done at its first byte.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from prefix_router.ops.procs import free_port
from tests.conftest import ProcessReaper
from tests.support.static_stack import StaticStack, start_static_stack
from tests.support.wait import async_wait_until
from tests.test_ext_proc_metrics import samples

pytestmark = pytest.mark.e2e

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
TOKENS = 120  # ~20 ms a decode step at time scale 1: ~2.4 s of streaming
LONG = 6000  # ~2 minutes of streaming: far longer than any wait below


def streamed_chat(text: str, tokens: int = TOKENS) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": text}],
        }
    ).encode()


class InFlight:
    def __init__(self, metrics_port: int) -> None:
        self.url = f"http://127.0.0.1:{metrics_port}/metrics"

    async def now(self) -> float:
        got = await asyncio.to_thread(samples, self.url)
        return sum(v for (name, _), v in got.items() if name == "prefix_router_ext_proc_in_flight")

    async def given_back(self) -> None:
        """Wait until the count is 0 again (the deadline is far from any generation's end)."""
        await async_wait_until(self.zero, 30, "the count is given back")

    async def zero(self) -> bool:
        return await self.now() == 0


@pytest.fixture
def metrics_port() -> int:
    return free_port()


@pytest.fixture(params=["http2", "grpcio"])
def stack(
    request: pytest.FixtureRequest, procs: ProcessReaper, log_dir: Path, metrics_port: int
) -> StaticStack:
    """On both of ext_proc's transports: each must end the session with the stream."""
    return start_static_stack(
        procs,
        log_dir,
        backends=2,
        sim_args=["--time-scale", "1"],
        ext_proc_args=["--metrics-port", str(metrics_port), "--transport", request.param],
    )


async def test_a_streamed_response_is_in_flight_until_its_last_token(
    stack: StaticStack, metrics_port: int
) -> None:
    in_flight = InFlight(metrics_port)
    seen = {}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream(
            "POST", f"{stack.url}/v1/chat/completions", content=streamed_chat("hold me")
        ) as response:
            assert response.status_code == 200
            tokens = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens += 1
                    # Not near the end: the client may read a token after the server
                    # sent the last one (on a busy machine, well after), and would then
                    # measure its own lag rather than the router.
                    if tokens in (1, TOKENS // 4, TOKENS // 2):
                        seen[tokens] = await in_flight.now()
    assert tokens >= TOKENS  # read to the end (a role chunk, then one a token)
    assert seen == {1: 1, TOKENS // 4: 1, TOKENS // 2: 1}
    await in_flight.given_back()


async def test_a_client_abort_gives_the_count_back_at_once(
    stack: StaticStack, metrics_port: int
) -> None:
    in_flight = InFlight(metrics_port)
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream(
            "POST", f"{stack.url}/v1/chat/completions", content=streamed_chat("abort me", LONG)
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    assert await in_flight.now() == 1
                    break  # leaving the iterator closes the connection
    # The client closed the connection with ~2 minutes of the generation still to come:
    # only the abort can give the count back within the wait's deadline.
    await in_flight.given_back()
