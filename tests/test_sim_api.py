"""The simulator's HTTP API: OpenAI client compatibility, metrics, bad input, faults, serving."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.support.wait import async_wait_until
from vllm_sim import SimInstance, create_app, make_config, start_instances
from vllm_sim.cli import main as cli_main
from vllm_sim.stats import E2E_BUCKETS, TTFT_BUCKETS

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
FAST = 1e6
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
async def sim() -> AsyncIterator[tuple[SimInstance, httpx.AsyncClient]]:
    instance = SimInstance(make_config(time_scale=FAST, lora_modules=("lora-a",)), name="sim-a")
    transport = httpx.ASGITransport(app=create_app(instance))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            yield instance, client
    finally:
        await instance.stop()


def openai_client(client: httpx.AsyncClient) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url="http://sim/v1", http_client=client)


async def tokens_of(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    response = await client.post("/tokenize", json=body)
    assert response.status_code == 200
    count: int = response.json()["count"]
    return count


async def test_openai_client_completions(sim: tuple[SimInstance, httpx.AsyncClient]) -> None:
    _, client = sim
    oai = openai_client(client)
    prompt = "The quick brown fox jumps over the lazy dog. " * 40
    n_prompt = await tokens_of(client, {"prompt": prompt})
    first = await oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert first.usage is not None and first.usage.completion_tokens == 5
    assert first.usage.prompt_tokens == n_prompt == -(-len(prompt) // 4)
    assert len(first.choices[0].text) == 4 * 5 and first.choices[0].finish_reason == "length"
    again = await oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
    )
    details = again.usage.prompt_tokens_details if again.usage else None
    assert details is not None and details.cached_tokens == (n_prompt - 1) // 16 * 16
    assert again.choices[0].text == first.choices[0].text  # deterministic output

    stream = await oai.completions.create(
        model=MODEL, prompt="hi", max_tokens=7, stream=True, extra_body={"ignore_eos": True}
    )
    texts = [chunk.choices[0].text async for chunk in stream]
    assert len(texts) == 7 and all(len(t) == 4 for t in texts)


async def test_openai_client_chat_stream_and_multi_turn(
    sim: tuple[SimInstance, httpx.AsyncClient],
) -> None:
    _, client = sim
    oai = openai_client(client)
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about prefix caching. " * 20},
    ]
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 40 and len(answer) == 160
    n_first = usage.prompt_tokens

    # The follow-up resends the answer: it hits the blocks filled while decoding it.
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    follow = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert follow.object == "chat.completion" and follow.choices[0].message.role == "assistant"
    assert follow.usage is not None and follow.usage.prompt_tokens_details is not None
    # KV exists for the prompt and all but the last generated token.
    assert follow.usage.prompt_tokens_details.cached_tokens == (n_first + 39) // 16 * 16
    assert follow.usage.prompt_tokens == await tokens_of(client, {"messages": messages})


async def test_cache_salt_and_lora_isolate_the_cache(
    sim: tuple[SimInstance, httpx.AsyncClient],
) -> None:
    _, client = sim
    body: dict[str, Any] = {"prompt": "shared system prompt " * 50, "max_tokens": 1}

    async def cached(**extra: Any) -> int:
        response = await client.post("/v1/completions", json={**body, **extra})
        assert response.status_code == 200, response.text
        value: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return value

    assert await cached(cache_salt="a") == 0
    assert await cached(cache_salt="a") > 0
    assert await cached(cache_salt="b") == 0
    assert await cached() == 0
    assert await cached(model="lora-a") == 0
    assert await cached(model="lora-a") > 0
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    assert await cached(model="lora-a") == 0


def test_public_names_are_exported() -> None:
    """``__all__`` is exactly the package's public names, each the object its module defines,
    and covers every name the docs import from ``vllm_sim``."""
    import vllm_sim

    exported = vllm_sim.__all__
    assert len(exported) == len(set(exported))
    public = {
        name
        for name, value in vars(vllm_sim).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(exported) == public
    namespace: dict[str, Any] = {}
    exec("from vllm_sim import *", namespace)
    assert set(namespace) - {"__builtins__"} == public
    modules = [m for n, m in list(sys.modules.items()) if n.startswith("vllm_sim.")]
    for name in exported:
        value = getattr(vllm_sim, name)
        assert any(getattr(m, name, None) is value for m in modules), name
    for doc in (REPO / "docs" / "simulator.md", REPO / "README.md"):
        for names in re.findall(r"from vllm_sim import ([\w, ]+)", doc.read_text()):
            assert {n.strip() for n in names.split(",")} <= public, (doc.name, names)


async def test_models_health_headers_and_request_id(
    sim: tuple[SimInstance, httpx.AsyncClient],
) -> None:
    _, client = sim
    models = await client.get("/v1/models")
    assert [m["id"] for m in models.json()["data"]] == [MODEL, "lora-a"]
    health = await client.get("/health", headers={"x-request-id": "abc-123"})
    assert health.status_code == 200
    assert health.headers["x-sim-instance"] == "sim-a"
    assert health.headers["x-request-id"] == "abc-123"
    bad = await client.post("/v1/completions", content=b"nope")
    assert bad.headers["x-sim-instance"] == "sim-a" and "x-request-id" not in bad.headers


async def test_metrics_parse_with_vllm_names(sim: tuple[SimInstance, httpx.AsyncClient]) -> None:
    instance, client = sim
    for _ in range(2):
        r = await client.post(
            "/v1/completions", json={"prompt": "y" * 400, "max_tokens": 3, "ignore_eos": True}
        )
        assert r.status_code == 200
    text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = {"model_name": MODEL, "engine": "0"}

    def value(family: str, sample: str, **extra: str) -> float:
        found = [
            s.value
            for s in families[family].samples
            if s.name == sample and s.labels == {**labels, **extra}
        ]
        assert len(found) == 1, (family, sample, extra)
        return found[0]

    assert families["vllm:num_requests_running"].type == "gauge"
    assert value("vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    assert value("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0
    queries = value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    hits = value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert (queries, hits) == (200, 96)  # 2 x 100 tokens; the second hits floor(99/16)*16
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 200
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 6
    assert (
        value("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    )
    assert value("vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    for hist, buckets in (
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
        ("vllm:e2e_request_latency_seconds", E2E_BUCKETS),
    ):
        assert families[hist].type == "histogram"
        bounds = [
            float(s.labels["le"]) for s in families[hist].samples if s.name == hist + "_bucket"
        ]
        assert bounds == [*buckets, float("inf")]
        assert value(hist, hist + "_count") == 2
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "81000"
    assert info.labels["enable_prefix_caching"] == "True"
    assert instance.state()["prefix_cache_hits"] == hits


BAD_REQUESTS: list[tuple[str, bytes, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, -2]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    (
        "/v1/completions",
        b'{"prompt": "x", "stream_options": {"include_usage": true}}',
        400,
        "stream_options",
    ),
    ("/v1/completions", b'{"prompt": "x", "cache_salt": ""}', 400, "cache_salt"),
    ("/v1/completions", b'{"prompt": "x", "cache_salt": 3}', 400, "cache_salt"),
    ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
    ("/v1/completions", b'{"prompt": "x", "model": 7}', 400, "model"),
    ("/v1/completions", b'{"prompt": "x", "ignore_eos": "no"}', 400, "ignore_eos"),
    ("/v1/completions", b'{"prompt": "x", "seed": 1.5}', 400, "seed"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 200000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"model": "gpt-4", "messages": []}', 404, "model"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    ("/v1/chat/completions", b"{}", 400, "messages"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [1]}', 400, "messages"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "wizard", "content": "x"}]}',
        400,
        "messages",
    ),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [1]}]}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "tools": {}}', 400, "tools"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user"}], "max_completion_tokens": -1}',
        400,
        "max_completion_tokens",
    ),
    ("/tokenize", b'{"model": "x", "prompt": "a"}', 404, "model"),
    ("/tokenize", b'{"text": "a"}', 400, "prompt"),
    ("/sim/fault", b'{"mode": "explode"}', 400, "mode"),
    ("/sim/fault", b'{"mode": "slow", "extra_latency_ms": -1}', 400, "extra_latency_ms"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_input_gets_openai_error(
    sim: tuple[SimInstance, httpx.AsyncClient],
    path: str,
    body: bytes,
    status: int,
    param: str | None,
) -> None:
    _, client = sim
    response = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert isinstance(error["message"], str) and error["message"]


async def test_multi_mib_bodies(sim: tuple[SimInstance, httpx.AsyncClient]) -> None:
    _, client = sim
    huge = {"prompt": "abcd" * (1 << 20), "max_tokens": 1}  # 4 MiB, 1M tokens: too long
    response = await client.post("/v1/completions", json=huge)
    assert response.status_code == 400 and "maximum context length" in response.text
    instance = SimInstance(make_config(time_scale=FAST, max_model_len=1 << 20), name="big")
    transport = httpx.ASGITransport(app=create_app(instance))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as big:
            body = {"messages": [{"role": "user", "content": "wxyz" * (3 << 18)}], "max_tokens": 1}
            response = await big.post("/v1/chat/completions", json=body)  # 3 MiB of content
    finally:
        await instance.stop()
    assert response.status_code == 200
    # content + "<|user|>\n" (3 tokens) + "\n" (1) + "<|assistant|>\n" (4)
    assert response.json()["usage"]["prompt_tokens"] == (3 << 18) + 3 + 1 + 4


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 70000)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "cache_salt",
    "ignore_eos",
    "n",
    "seed",
    "tools",
    "temperature",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
)
def test_fuzzed_bodies_never_get_a_500(path: str, body: dict[str, Any]) -> None:
    async def one() -> int:
        instance = SimInstance(make_config(time_scale=FAST, num_gpu_blocks=4096), name="fuzz")
        transport = httpx.ASGITransport(app=create_app(instance))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
                response = await client.post(path, content=orjson.dumps(body))
        finally:
            await instance.stop()
        return response.status_code

    assert asyncio.run(one()) in (200, 400, 404)


async def test_fault_injection(sim: tuple[SimInstance, httpx.AsyncClient]) -> None:
    _, client = sim
    request = {"prompt": "hello", "max_tokens": 2}
    assert (await client.get("/sim/fault")).json()["mode"] == "none"

    assert (await client.post("/sim/fault", json={"mode": "unhealthy"})).status_code == 200
    assert (await client.get("/health")).status_code == 503
    down = await client.post("/v1/completions", json=request)
    assert down.status_code == 503 and down.json()["error"]["code"] == 503
    assert (await client.get("/metrics")).status_code == 200

    await client.post("/sim/fault", json={"mode": "hang"})
    pending = asyncio.ensure_future(client.post("/v1/completions", json=request))
    health = asyncio.ensure_future(client.get("/health"))
    done, _ = await asyncio.wait({pending, health}, timeout=0.2)
    assert not done  # neither answers while hung
    assert (await client.get("/sim/fault")).json()["mode"] == "hang"
    await client.post("/sim/fault", json={"mode": "none"})
    assert (await pending).status_code == 200 and (await health).status_code == 200

    await client.post("/sim/fault", json={"mode": "slow", "extra_latency_ms": 150})
    start = time.monotonic()
    assert (await client.post("/v1/completions", json=request)).status_code == 200
    assert time.monotonic() - start >= 0.15  # the added latency is a floor: it cannot flake
    # Clearing it: a request that would wait 10 minutes under the fault answers at once.
    await client.post("/sim/fault", json={"mode": "slow", "extra_latency_ms": 600_000})
    await client.post("/sim/fault", json={"mode": "none"})
    answer = await asyncio.wait_for(client.post("/v1/completions", json=request), 60)
    assert answer.status_code == 200


async def test_state_shows_requests_in_flight() -> None:
    instance = SimInstance(make_config(time_scale=20.0), name="slowish")
    transport = httpx.ASGITransport(app=create_app(instance))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            body = {"prompt": "in flight", "max_tokens": 40, "ignore_eos": True}
            calls = [
                asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)
            ]
            seen = 0

            async def all_running() -> bool:
                nonlocal seen
                seen = max(seen, (await client.get("/sim/state")).json()["running"])
                return seen == 3

            await async_wait_until(all_running, 30, "three requests run at once", interval=0.005)
            responses = await asyncio.gather(*calls)
            final = (await client.get("/sim/state")).json()
    finally:
        await instance.stop()
    assert seen == 3
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert final["running"] == 0 and final["finished"] == {"length": 3}
    assert final["peak_in_flight"] == 3  # the high-water mark outlives the requests


async def test_instances_over_real_http_and_client_disconnect_aborts() -> None:
    cluster = await start_instances(config=make_config(time_scale=50.0), ports=[0, 0])
    try:
        names = set()
        async with httpx.AsyncClient(timeout=10) as client:
            for member in cluster.members:
                response = await client.get(member.url + "/health")
                assert response.status_code == 200
                assert response.headers["x-sim-instance"] == str(member.port)
                names.add(response.headers["x-sim-instance"])
            url = cluster.urls[0]
            body = {"prompt": "stream me", "max_tokens": 500, "ignore_eos": True, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as stream:
                first = await stream.aiter_bytes().__anext__()
                assert first.startswith(b"data: ")
            state: dict[str, Any] = {}

            async def aborted() -> bool:
                nonlocal state
                state = (await client.get(url + "/sim/state")).json()
                return bool(state["finished"].get("abort"))

            await async_wait_until(aborted, 30, "the instance counts the abort")
            assert state["finished"] == {"abort": 1} and state["running"] == 0
            assert state["num_free_blocks"] == state["num_gpu_blocks"]
        assert len(names) == 2
    finally:
        await cluster.stop()


def _read_ready_lines(proc: subprocess.Popen[str], count: int) -> list[str]:
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 20
    while len(lines) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if " ready on " in line:
            lines.append(line.strip())
    return lines


def test_cli_serves_instances_in_a_subprocess_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_sim",
            "--instances",
            "2",
            "--base-port",
            "0",
            "--time-scale",
            "1000",
            "--model",
            "test-model",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,  # its own group: stopped whole below, on every path
    )
    try:
        lines = _read_ready_lines(proc, 2)
        assert len(lines) == 2, lines
        urls = [line.split(" ready on ")[1].split()[0] for line in lines]
        with httpx.Client(timeout=10) as client:
            served_by = set()
            for url in urls:
                response = client.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": "test-model",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4,
                    },
                )
                assert response.status_code == 200, response.text
                served_by.add(response.headers["x-sim-instance"])
            assert served_by == {url.rsplit(":", 1)[1] for url in urls}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.returncode is None:  # not reaped: the group id is still ours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_cli_exit_codes() -> None:
    assert cli_main(["--instances", "1", "--base-port", "0", "--time-scale", "0"]) == 2
    assert cli_main(["--instances", "1", "--base-port", "0", "--num-gpu-blocks", "0"]) == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli_main(["--ports", f"0,{port}", "--time-scale", "10"]) == 1
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()):
        cli_main(["--profile", "no-such-profile"])
    assert exited.value.code == 2


async def test_an_adapter_loaded_at_runtime_is_served_and_listed_until_unloaded(
    sim: tuple[SimInstance, httpx.AsyncClient],
) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, which the control plane's
    model discovery follows."""
    _, client = sim
    body = {"model": "lora-b", "messages": [{"role": "user", "content": "hi"}]}

    async def listed() -> list[str]:
        return [m["id"] for m in (await client.get("/v1/models")).json()["data"]]

    assert (await client.post("/v1/chat/completions", json=body)).status_code == 404
    loaded = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "lora-b", "lora_path": "/adapters/b"}
    )
    assert loaded.status_code == 200
    assert await listed() == [MODEL, "lora-a", "lora-b"]
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    again = await client.post("/v1/load_lora_adapter", json={"lora_name": "lora-b"})
    assert again.status_code == 400
    assert (
        await client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-b"})
    ).status_code == 200
    assert await listed() == [MODEL, "lora-a"]
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 404
    missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-b"})
    assert missing.status_code == 404
    assert (await client.post("/v1/load_lora_adapter", json={})).status_code == 400


async def test_each_instance_serves_its_own_models_when_given() -> None:
    config = make_config(time_scale=FAST)
    cluster = await start_instances(
        config=config, ports=[0, 0, 0], serve=[("base-a", "sql-lora"), ("base-b",)]
    )
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            served = [
                [m["id"] for m in (await client.get(f"{m.url}/v1/models")).json()["data"]]
                for m in cluster.members
            ]
            parents = {
                m["id"]: m["parent"]
                for m in (await client.get(f"{cluster.members[0].url}/v1/models")).json()["data"]
            }
    finally:
        await cluster.stop()
    assert served == [["base-a", "sql-lora"], ["base-b"], ["base-a", "sql-lora"]]
    assert parents == {"base-a": None, "sql-lora": "base-a"}
