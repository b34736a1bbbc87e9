"""Pools by model through the whole stack: simulated vLLM instances serving two base models
and an adapter, the control plane publishing a cluster per pool over xDS, ext_proc sharing
its routing state in Redis, and real Envoy.

The simulator answers 404 to a model it does not serve (as vLLM does), so a request that
reached the wrong instance would not be a 200, and each answer names its instance
(``x-sim-instance``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from prefix_router.core.config import RouterConfig
from tests.conftest import ProcessReaper
from tests.support.redis_ns import delete_namespace, unique_namespace
from tests.support.wait import wait_until
from tests.support.xds_stack import XdsStack, start_xds_stack

pytestmark = pytest.mark.e2e

# In the fleet: base-a on three instances, its adapter a-sql on two of them, base-b on two.
SERVES = [["base-a"], ["base-a", "a-sql"], ["base-a", "a-sql"], ["base-b"], ["base-b"]]
SPARE = ["base-b"]  # running outside the fleet until a test adds it
THRESHOLD = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[XdsStack]:
    procs = ProcessReaper()
    log_dir = tmp_path_factory.mktemp("pools") / "logs"
    log_dir.mkdir()
    namespace = unique_namespace()
    config = RouterConfig.model_validate(
        {"concurrency_threshold": THRESHOLD, "placement": {"width": 1}}
    )
    serve = [arg for served in [*SERVES, SPARE] for arg in ("--serve", ",".join(served))]
    try:
        stack, _ = start_xds_stack(
            procs,
            log_dir,
            namespace,
            backends=len(SERVES),
            spare_backends=1,
            config=config,
            ext_procs=2,
            sim_args=["--time-scale", "1", "--default-max-tokens", "24", *serve],
            models=SERVES,
        )
        wait_until(stack.converged, 30, "Envoy and ext_proc run the fleet")
        yield stack
    finally:
        procs.stop_all()
        delete_namespace(namespace)


def chat(model: str, text: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}


async def send_all(stack: XdsStack, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return await asyncio.gather(
            *(client.post(f"{stack.url}/v1/chat/completions", json=b) for b in bodies)
        )


def upstream_requests(stack: XdsStack) -> int:
    """Requests Envoy sent to any model-serving cluster."""
    stats = stack.envoy_json("/stats?format=json&filter=^cluster\\.models.*upstream_rq_total$")
    return sum(int(s["value"]) for s in stats["stats"])


def members(stack: XdsStack, model: str) -> set[str]:
    return {
        str(p) for p, served in zip(stack.backend_ports, SERVES, strict=False) if model in served
    }


def test_no_request_reaches_an_instance_that_does_not_serve_its_model(stack: XdsStack) -> None:
    models = ["base-a", "a-sql", "base-b"]
    bodies = [chat(models[n % 3], f"conversation {n // 3} " * 30) for n in range(90)]
    answers = asyncio.run(send_all(stack, bodies))
    seen: dict[str, set[str]] = {m: set() for m in models}
    for body, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, answer.text
        model = str(body["model"])
        assert answer.json()["model"] == model
        seen[model].add(answer.headers["x-sim-instance"])
    for model in models:
        assert seen[model] <= members(stack, model), model
    assert seen["base-b"] == members(stack, "base-b")  # each pool's keys spread over it


def test_a_hot_prefix_spills_only_inside_its_pool(stack: XdsStack) -> None:
    """Held in flight at once, the a-sql requests of one prefix exceed ConcurrencyThreshold
    on their home and spill: onto the other a-sql instance, never onto base-a or base-b's."""
    hot = "the shared system prompt of the SQL assistant " * 40
    bodies = [chat("a-sql", hot + f"question {n}") for n in range(16)]
    answers = asyncio.run(send_all(stack, bodies))
    assert all(a.status_code == 200 for a in answers)
    used = {a.headers["x-sim-instance"] for a in answers}
    assert used == members(stack, "a-sql")


def test_an_unknown_model_is_answered_by_the_router_as_vllm_answers_it(
    stack: XdsStack,
) -> None:
    before = upstream_requests(stack)
    with httpx.Client(timeout=10) as client:
        answer = client.post(f"{stack.url}/v1/chat/completions", json=chat("base-c", "hello"))
        listed = client.get(f"{stack.url}/v1/models")
    assert answer.status_code == 404
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)
    assert "`base-c`" in error["message"]
    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["a-sql", "base-a", "base-b"]
    assert upstream_requests(stack) == before  # neither touched an instance


def test_an_instance_added_to_a_pool_takes_only_that_pools_keys(stack: XdsStack) -> None:
    spare = stack.backend_ports[len(SERVES)]
    with stack.admin() as admin:
        added = admin.post(
            "/instances", json={"address": "127.0.0.1", "port": spare, "models": SPARE}
        )
        assert added.status_code == 201, added.text
    try:
        wait_until(stack.converged, 30, "Envoy and ext_proc run the grown fleet")
        models = ["base-a", "a-sql", "base-b"]
        bodies = [chat(models[n % 3], f"a new prompt {n} " * 20) for n in range(150)]
        answers = asyncio.run(send_all(stack, bodies))
        took: dict[str, set[str]] = {m: set() for m in models}
        for body, answer in zip(bodies, answers, strict=True):
            assert answer.status_code == 200, answer.text
            took[str(body["model"])].add(answer.headers["x-sim-instance"])
        assert str(spare) in took["base-b"]
        assert str(spare) not in took["base-a"] | took["a-sql"]
    finally:
        with stack.admin() as admin:
            admin.delete(f"/instances/127.0.0.1:{spare}")


def test_a_request_naming_no_model_still_goes_through(stack: XdsStack) -> None:
    """Not a pool's request (no model field): over the whole fleet, as before pools; the
    instance it reaches answers for itself."""
    with httpx.Client(timeout=10) as client:
        answer = client.post(
            f"{stack.url}/v1/chat/completions",
            content=json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        )
    assert answer.headers.get("x-sim-instance") in {str(p) for p in stack.backend_ports}


def test_a_client_sent_pool_header_never_picks_the_cluster(stack: XdsStack) -> None:
    """Envoy picks a request's route before any HTTP filter runs: a client's own
    x-prefix-pool must be gone by then, or a request ext_proc leaves unpooled (here one
    naming no model) would go to the cluster the client chose."""
    base_b = members(stack, "base-b")
    with httpx.Client(timeout=10) as client:
        reached = {
            client.post(
                f"{stack.url}/v1/chat/completions",
                content=json.dumps({"messages": [{"role": "user", "content": f"hi {n}"}]}),
                headers={"x-prefix-pool": "models/base-b"},
            ).headers.get("x-sim-instance")
            for n in range(30)
        }
    assert reached - base_b, reached  # over the whole fleet, not only base-b's instances
