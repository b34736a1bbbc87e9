"""Hostile bodies: key extraction and the ext_proc message handler never raise.

Property-based (hypothesis): huge, deeply nested, invalid UTF-8, wrong types,
empty and truncated bodies. The handler is driven with real protobuf messages
through its gRPC method, with the in-process load store.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc.router import RequestRouter
from ext_proc.servicer import ExternalProcessor
from prefix_router.config import PrefixMode, RouterConfig
from prefix_router.fleet import Fleet, Instance
from prefix_router.loads import InMemoryLoadStore
from prefix_router.prefix_key import KeySettings, extract_key
from prefix_router.routing import RoutingTable

PATHS = st.sampled_from(
    ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/", ""]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=30,
)
openai_like = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "messages": json_values
        | st.lists(
            st.dictionaries(
                st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id"]),
                json_values,
            )
        ),
        "prompt": json_values,
        "tools": json_values,
        "cache_salt": json_values,
        "input": json_values,
        "instructions": json_values,
    },
)


def hostile_bodies() -> st.SearchStrategy[bytes]:
    as_json = openai_like.map(lambda d: json.dumps(d, allow_nan=True).encode())
    truncated = as_json.flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n]))
    nested = st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth)
    deep_object = st.integers(1, 3000).map(
        lambda depth: b'{"messages":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
    )
    return st.one_of(st.binary(max_size=4096), as_json, truncated, nested, deep_object)


SETTINGS = [KeySettings(1024, PrefixMode.OPENAI), KeySettings(7, PrefixMode.BYTES)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=hostile_bodies(), path=PATHS, tenant=st.text(max_size=20), complete=st.booleans())
def test_extract_key_never_raises_and_is_fast(
    body: bytes, path: str, tenant: str, complete: bool
) -> None:
    for key_settings in SETTINGS:
        started = time.process_time()  # CPU time: a busy machine does not inflate it
        key = extract_key(body, settings=key_settings, path=path, tenant=tenant, complete=complete)
        assert time.process_time() - started < 0.25
        assert len(key.value) == 32


def test_a_huge_body_is_keyed_quickly() -> None:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * (16 * 1024 * 1024)}]}
    ).encode()
    started = time.process_time()
    extract_key(body, settings=SETTINGS[0], path="/v1/chat/completions")
    assert time.process_time() - started < 0.5


def header(key: str, value: str) -> base_pb2.HeaderValue:
    return base_pb2.HeaderValue(key=key, raw_value=value.encode("utf-8", "surrogatepass"))


async def messages(body: bytes, path: str, tenant: str) -> AsyncIterator[pb.ProcessingRequest]:
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                header(":path", path),
                header(":method", "POST"),
                header("x-tenant-id", tenant),
            ]
        )
    )
    yield pb.ProcessingRequest(request_headers=headers)
    yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    yield pb.ProcessingRequest(response_headers=pb.HttpHeaders())


ROUTER = RequestRouter(
    RoutingTable.build(
        Fleet.of([Instance("127.0.0.1", 8000 + i) for i in range(3)]), RouterConfig()
    ),
    InMemoryLoadStore(),
)


async def run_handler(body: bytes, path: str, tenant: str) -> list[Any]:
    servicer = ExternalProcessor(ROUTER)  # the fake client half-closes, as Envoy does
    return [r async for r in servicer.Process(messages(body, path, tenant), None)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=hostile_bodies(), path=PATHS, tenant=st.text(max_size=20))
def test_the_handler_answers_every_message_and_releases_its_count(
    body: bytes, path: str, tenant: str
) -> None:
    started = time.perf_counter()
    responses = asyncio.run(run_handler(body, path, tenant))
    assert time.perf_counter() - started < 1.0  # bounded, with room for a busy machine
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds == ["request_headers", "request_body", "response_headers"]
    mutation = responses[1].request_body.response.header_mutation.set_headers
    assert [h.header.key for h in mutation] == ["x-prefix-key"]
    assert asyncio.run(ROUTER.store.in_flight()) == {}


@pytest.mark.parametrize("end", ["half-close", "reset"])
async def test_the_count_is_held_until_envoy_ends_the_stream(end: str) -> None:
    """After the response headers the handler reads on: the request is in flight until
    Envoy ends the stream, by a half-close (graceful close, our bootstrap) or a reset
    (a cancellation: a client abort on an Envoy without it). Either gives the count back."""
    close = asyncio.Event()

    async def envoy() -> AsyncIterator[pb.ProcessingRequest]:
        async for message in messages(b'{"model": "m", "prompt": "hi"}', "/v1/completions", ""):
            yield message
        await close.wait()  # the response streams

    store = InMemoryLoadStore()
    servicer = ExternalProcessor(RequestRouter(ROUTER.table, store))
    answered: list[Any] = []

    async def run() -> None:
        async for response in servicer.Process(envoy(), None):
            answered.append(response)

    stream = asyncio.create_task(run())
    for _ in range(200):
        if len(answered) == 3:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    assert len(answered) == 3 and not stream.done()
    assert sum((await store.in_flight()).values()) == 1 and servicer.open_streams == 1
    if end == "half-close":
        close.set()
        await asyncio.wait_for(stream, 1.0)
    else:
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    assert sum((await store.in_flight()).values()) == 0 and servicer.open_streams == 0
