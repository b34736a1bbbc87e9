"""Model discovery: each instance's GET /v1/models, parsed (pure), and followed through the
control plane, ext_proc and Envoy while adapters are loaded and unloaded at runtime."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Header, HTTPException

from control_plane.models import ModelDiscovery, disagreements, parse_models, pools_doc
from prefix_router.core.fleet import Fleet, Instance, ServedModel
from prefix_router.ops.procs import free_port
from tests.conftest import ProcessReaper
from tests.support.redis_ns import delete_namespace, fresh_store, unique_namespace
from tests.support.uvicorn_server import uvicorn_serving
from tests.support.wait import wait_until
from tests.support.xds_stack import XdsStack, start_xds_stack

VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "base-a", "object": "model", "root": "base-a", "parent": None},
        {"id": "a-sql", "object": "model", "root": "/adapters/sql", "parent": "base-a"},
    ],
}


@pytest.mark.parametrize(
    ("payload", "found"),
    [
        (VLLM_MODELS, (ServedModel("base-a"), ServedModel("a-sql", "base-a"))),
        ({"object": "list", "data": []}, ()),
        # a name that could not be a pool is left out, the rest kept
        ({"data": [{"id": "has space"}, {"id": "ok"}]}, (ServedModel("ok"),)),
        ({"data": [{"id": "dup"}, {"id": "dup", "parent": "x"}]}, (ServedModel("dup"),)),
        ({"backend": "8001"}, None),  # not vLLM (an echo server)
        ({"data": [{"name": "x"}]}, None),
        ([1, 2], None),
        (None, None),
    ],
)
def test_a_vllm_model_list_is_parsed_and_anything_else_is_not_one(
    payload: Any, found: tuple[ServedModel, ...] | None
) -> None:
    assert parse_models(payload) == found


def test_declared_and_discovered_disagreements_are_listed() -> None:
    agree = Instance("10.0.0.1", 1, models=("a",), discovered=(ServedModel("a"),))
    differ = Instance(
        "10.0.0.1", 2, models=("a", "b"), discovered=(ServedModel("a"), ServedModel("c", "a"))
    )
    undeclared = Instance("10.0.0.1", 3, discovered=(ServedModel("a"),))
    undiscovered = Instance("10.0.0.1", 4, models=("a",))
    assert disagreements([agree, differ, undeclared, undiscovered]) == [
        {"instance": "10.0.0.1:2", "declared_only": ["b"], "discovered_only": ["c"]}
    ]
    doc = pools_doc(Fleet.of([agree, differ, undeclared, Instance("10.0.0.1", 5)]))
    assert doc["pools"] == {
        "a": ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3", "10.0.0.1:5"],
        "b": ["10.0.0.1:2", "10.0.0.1:5"],
    }
    assert doc["catch_all"] == ["10.0.0.1:5"] and doc["pooled"]


SERVES = [["base-a"], ["base-a", "a-sql"], ["base-b"]]


async def test_instances_run_with_an_api_key_are_asked_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM started with ``--api-key`` refuses ``/v1/models`` without it: discovery sends
    the key it was given, and says once per instance why it learns nothing without."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        if authorization != "Bearer sk-test":
            raise HTTPException(401, "unauthorized")
        return VLLM_MODELS

    port = free_port()
    instance = Instance("127.0.0.1", port)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    async with uvicorn_serving(config), fresh_store() as store:
        with_key = ModelDiscovery(store, api_key="sk-test")
        assert await with_key.ask(instance) == parse_models(VLLM_MODELS)
        without = ModelDiscovery(store)
        caplog.set_level(logging.WARNING, logger="prefix_router.control_plane.models")
        assert await without.ask(instance) is None
        assert await without.ask(instance) is None
        [record] = [r for r in caplog.records if "answered 401" in r.getMessage()]
        assert "VLLM_API_KEY" in record.getMessage()


@pytest.fixture
def stack(procs: ProcessReaper, log_dir: Any) -> Iterator[XdsStack]:
    namespace = unique_namespace()
    serve = [arg for served in SERVES for arg in ("--serve", ",".join(served))]
    try:
        stack, _ = start_xds_stack(
            procs,
            log_dir,
            namespace,
            backends=len(SERVES),
            sim_args=["--time-scale", "100", *serve],
            extra_cp_args=["--discover-models", "--model-discovery-interval", "0.2"],
        )
        yield stack
    finally:
        procs.stop_all()
        delete_namespace(namespace)


def chat(model: str, text: str = "hello") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def pools(stack: XdsStack) -> dict[str, set[str]]:
    with stack.admin() as admin:
        return {m: set(ids) for m, ids in admin.get("/status").json()["models"]["pools"].items()}


@pytest.mark.e2e
def test_pools_are_learned_followed_and_overridden_by_declared_models(stack: XdsStack) -> None:
    a, b, c = (f"127.0.0.1:{p}" for p in stack.backend_ports)
    wanted = {"base-a": {a, b}, "a-sql": {b}, "base-b": {c}}
    wait_until(lambda: pools(stack) == wanted, 30, "the pools were discovered")
    wait_until(stack.converged, 30, "Envoy and ext_proc run the discovered fleet")
    with httpx.Client(timeout=10) as client:
        for _ in range(10):
            answer = client.post(f"{stack.url}/v1/chat/completions", json=chat("a-sql"))
            assert answer.status_code == 200 and answer.headers["x-sim-instance"] == b.split(":")[1]
        assert client.post(f"{stack.url}/v1/chat/completions", json=chat("x")).status_code == 404

        # an adapter loaded at runtime on the third instance joins its pool
        loaded = client.post(f"http://{c}/v1/load_lora_adapter", json={"lora_name": "b-chat"})
        assert loaded.status_code == 200
        wait_until(lambda: pools(stack).get("b-chat") == {c}, 30, "b-chat was discovered")
        wait_until(stack.converged, 30, "Envoy and ext_proc route b-chat")
        assert (
            client.post(f"{stack.url}/v1/chat/completions", json=chat("b-chat")).status_code == 200
        )
        client.post(f"http://{c}/v1/unload_lora_adapter", json={"lora_name": "b-chat"})
        wait_until(lambda: "b-chat" not in pools(stack), 30, "b-chat's unloading was seen")

    # declared models win, and /status says where they disagree with what was found
    with stack.admin() as admin:
        assert admin.patch(f"/instances/{c}", json={"models": ["base-b", "b-old"]}).is_success
        wait_until(lambda: "b-old" in pools(stack), 30, "the declared models route")
        status = admin.get("/status").json()
        fleet = admin.get("/fleet").json()
    assert status["models"]["disagreements"] == [
        {"instance": c, "declared_only": ["b-old"], "discovered_only": []}
    ]
    assert fleet["models"]["pools"]["b-old"] == [c]
    assert "b-old" not in {m["id"] for m in discovered(stack, c)}


def discovered(stack: XdsStack, instance: str) -> list[dict[str, Any]]:
    with stack.admin() as admin:
        return list(admin.get(f"/instances/{instance}").json()["instance"]["discovered"])
