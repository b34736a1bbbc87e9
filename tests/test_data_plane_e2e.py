"""The data path end to end: real Envoy, real ext_proc (gRPC), real HTTP backends."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections import Counter
from pathlib import Path

import httpx
import pytest
import uvicorn

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.ring import Ring
from prefix_router.envoy.cluster import model_cluster
from tests.conftest import ProcessReaper
from tests.support.static_stack import StaticStack, envoy_stats, start_static_stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e


def chat(content: str, **extra: object) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    ).encode()


def post(client: httpx.Client, stack: StaticStack, body: bytes, **headers: str) -> dict[str, str]:
    r = client.post(f"{stack.url}/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture
def stack(procs: ProcessReaper, log_dir: Path) -> StaticStack:
    return start_static_stack(procs, log_dir, backends=3)


@pytest.fixture(params=["http2", "grpcio"])
def any_transport_stack(
    request: pytest.FixtureRequest, procs: ProcessReaper, log_dir: Path
) -> StaticStack:
    """ext_proc on our HTTP/2 server (the default) or on grpcio (the fallback)."""
    return start_static_stack(
        procs, log_dir, backends=3, ext_proc_args=["--transport", request.param]
    )


def test_one_prefix_lands_on_one_backend(stack: StaticStack) -> None:
    with httpx.Client(timeout=10) as client:
        seen = {post(client, stack, chat("the same prompt"))["backend"] for _ in range(50)}
    assert len(seen) == 1


def test_distinct_prefixes_reach_every_backend_as_the_mirror_predicts(
    any_transport_stack: StaticStack,
) -> None:
    stack = any_transport_stack
    ring = Ring.build(stack.fleet.routable, minimum_ring_size=256 * 3)
    seen: Counter[str] = Counter()
    with httpx.Client(timeout=10) as client:
        for i in range(200):
            answer = post(client, stack, chat(f"prompt number {i}"))
            seen[answer["backend"]] += 1
            predicted = ring.pick(answer["prefix_key"])
            assert predicted is not None and str(predicted.port) == answer["backend"]
    assert len(seen) == 3, seen


def test_requests_succeed_while_ext_proc_is_stopped(stack: StaticStack) -> None:
    stack.ext_procs[0].stop()
    with httpx.Client(timeout=10) as client:
        for i in range(20):
            answer = post(client, stack, chat(f"no router {i}"))
            assert answer["prefix_key"] is None


def test_large_bodies_pass_and_oversized_ones_get_413(stack: StaticStack) -> None:
    with httpx.Client(timeout=120) as client:
        for size in (4 * 1024 * 1024, 16 * 1024 * 1024):
            try:
                answer = post(client, stack, chat("x" * size))
            except httpx.TimeoutException as exc:
                assert stack.envoy is not None
                logs = [stack.envoy.tail(), *(p.tail() for p in stack.ext_procs)]
                raise AssertionError(f"{size} B body timed out; logs:\n" + "\n".join(logs)) from exc
            assert answer["bytes"] > size
            assert answer["prefix_key"]
    # Envoy answers from the declared length, before reading a byte of the body.
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n{" % (64 * 1024 * 1024 + 1)
        )
        answer = conn.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 413"), answer
    assert "larger than" in answer


def test_a_client_sent_prefix_key_never_decides(stack: StaticStack) -> None:
    body = chat("forged")
    with httpx.Client(timeout=10) as client:
        honest = post(client, stack, body)["prefix_key"]
        forged = {
            post(client, stack, body, **{"x-prefix-key": f"forged-{i}"})["prefix_key"]
            for i in range(20)
        }
        assert forged == {honest}
        stack.ext_procs[0].stop()
        # ext_proc down: the forged header is still removed before anything routes on it.
        forged_down = [
            post(client, stack, body, **{"x-prefix-key": "forged"})["prefix_key"] for _ in range(5)
        ]
        assert forged_down == [None] * 5


def test_prefix_mode_bytes_keys_on_raw_bytes(procs: ProcessReaper, log_dir: Path) -> None:
    config = RouterConfig.model_validate({"prefix_mode": "bytes", "prefix_length": 8})
    stack = start_static_stack(procs, log_dir, backends=3, config=config)
    rng = random.Random(7)
    with httpx.Client(timeout=10) as client:
        keys = {
            post(client, stack, b"samefirst" + rng.randbytes(40))["prefix_key"] for _ in range(10)
        }
    assert len(keys) == 1


async def test_more_than_a_thousand_requests_in_flight_are_all_routed(stack: StaticStack) -> None:
    """Each request holds an ext_proc stream until it ends; past Envoy's default circuit
    breaker (1,024 streams) the rest would go on unrouted, with no error anywhere."""
    n = 1200
    port = int(stack.url.rsplit(":", 1)[1])

    async def held(i: int) -> dict[str, str]:
        # 100 new requests every 0.1 s, each held 4 s: all 1,200 overlap, while no burst
        # outruns ext_proc's 500 ms answer timeout on a busy machine (that, too, would
        # send requests on unrouted, for another reason than the one tested here).
        await asyncio.sleep(i // 100 * 0.1)
        # Raw HTTP/1.1, one connection each: httpx's pool costs O(n) per request here.
        body = chat(f"held {i}")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-hold-ms: 4000\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            answer = await asyncio.wait_for(reader.read(), timeout=60)
        finally:
            writer.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        # The body may come chunked: the JSON object is between its outer braces.
        return json.loads(payload[payload.index(b"{") : payload.rindex(b"}") + 1])  # type: ignore[no-any-return]

    answers = await asyncio.gather(*(held(i) for i in range(n)))
    unrouted = sum(1 for a in answers if a["prefix_key"] is None)
    assert unrouted == 0, f"{unrouted} of {n} requests went on without a prefix key"


def test_envoy_closes_connections_past_its_limit_and_keeps_serving(
    procs: ProcessReaper, log_dir: Path
) -> None:
    """An open-loop overload once opened connections until Envoy ran out of file
    descriptors and crashed; past ``max_downstream_connections`` it now closes new ones."""
    stack = start_static_stack(procs, log_dir, backends=1, max_downstream_connections=20)
    port = int(stack.url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
    try:
        closed = 0
        for sock in held:
            sock.settimeout(0.5)
            try:
                closed += sock.recv(1) == b""
            except TimeoutError:
                pass  # kept open
        assert 15 <= closed <= 25, closed  # about every connection past the 20th
    finally:
        for sock in held:
            sock.close()
    stats = httpx.get(f"http://127.0.0.1:{stack.admin_port}/stats?filter=global_cx_overflow")
    assert any(int(line.rsplit(" ", 1)[1]) > 0 for line in stats.text.splitlines()), stats.text
    with httpx.Client(timeout=10) as client:
        post(client, stack, chat("still serving"))


def test_envoy_closes_idle_upstream_connections_before_the_server_does(
    procs: ProcessReaper, log_dir: Path
) -> None:
    """A request sent on a connection the server is closing fails before reaching it. The
    model cluster's idle timeout is shorter than uvicorn's keep-alive (vLLM runs on
    uvicorn; so does the echo backend, with uvicorn's default), so Envoy closes first."""
    keep_alive = uvicorn.Config(app=None).timeout_keep_alive
    cluster = model_cluster(RouterConfig(), Fleet.of([Instance("127.0.0.1", 1)]), eds=False)
    options = next(iter(cluster["typed_extension_protocol_options"].values()))
    idle = float(options["common_http_protocol_options"]["idle_timeout"].rstrip("s"))
    assert idle < keep_alive, (idle, keep_alive)

    stack = start_static_stack(procs, log_dir, backends=1)
    with httpx.Client(timeout=10) as client:
        answer = client.post(f"{stack.url}/v1/chat/completions", content=chat("idle after me"))
    assert answer.status_code == 200

    def closed_by_envoy() -> bool:
        stats = envoy_stats(stack, r"^cluster\.models\.upstream_cx_idle_timeout$")
        return stats["cluster.models.upstream_cx_idle_timeout"] >= 1

    wait_until(closed_by_envoy, 30, "Envoy closes the idle upstream connection")
    stats = envoy_stats(stack, r"^cluster\.models\.upstream_cx_(destroy_remote|active)$")
    assert stats["cluster.models.upstream_cx_destroy_remote"] == 0, stats  # never the server
