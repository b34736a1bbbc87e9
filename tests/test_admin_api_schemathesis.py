"""Property-based API testing of the admin API from its own OpenAPI schema (schemathesis):
whatever the input, never a 5xx, and a refused call (4xx) changes nothing: the fleet, the
config, their versions and the audit log read the same before and after it. Plus a table
of known-bad calls. Against a real control-plane process and real Redis."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings

from prefix_router.ops.launch import start_module
from prefix_router.ops.procs import free_port
from prefix_router.state.store import Keys
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.redis_ns import fresh_store, unique_namespace

pytestmark = pytest.mark.e2e

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PUBLIC = {"/healthz", "/metrics", "/ui", "/status/page"}
"""Routes that need no token: the health probe, Prometheus scrapes, the page shell."""


@pytest.fixture(scope="module")
def namespace() -> str:
    """The control plane's Redis namespace (module-wide, like the process)."""
    return unique_namespace()


@pytest.fixture(scope="module")
def admin_url(namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_dir: Path = tmp_path_factory.mktemp("schemathesis")
    fleet = log_dir / "fleet.yaml"
    fleet.write_text("instances:\n- {address: 127.0.0.1, port: 9}\n")
    xds, admin = free_port(), free_port()
    reaper = ProcessReaper()
    try:
        reaper.add(
            start_module(
                "control-plane", "prefix_router",
                ["control-plane", "--xds-port", str(xds), "--admin-port", str(admin),
                 "--redis-url", REDIS_URL, "--namespace", namespace, "--fleet", str(fleet),
                 "--no-health-probe"],
                log_dir, ready_ports=[admin], env={"PREFIX_ROUTER_ADMIN_TOKEN": TOKEN},
            )
        )  # fmt: skip
        yield f"http://127.0.0.1:{admin}"
    finally:
        reaper.stop_all()

        async def clean() -> None:
            async with fresh_store(namespace):
                pass

        asyncio.run(clean())


@pytest.fixture(scope="module")
def admin_schema(admin_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{admin_url}/openapi.json", headers=AUTH)


WRITES = {"POST", "PUT", "PATCH", "DELETE"}


def state_of(namespace: str) -> tuple[Any, ...] | None:
    """The shared state a call could change, read from Redis itself: the fleet and config
    documents (with their versions) and the audit log (its length and latest entry). None
    while a drain is under way: the drainer changes the fleet by itself then, so a
    before/after comparison would prove nothing."""
    keys = Keys(namespace)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        fleet, config = client.get(keys.fleet), client.get(keys.config)
        audit = (client.llen(keys.audit), client.lindex(keys.audit, 0))
    finally:
        client.close()
    if fleet is None or json.loads(fleet).get("removing"):
        return None
    return fleet, config, audit


def test_no_input_makes_the_admin_api_fail_and_a_refused_one_changes_nothing(
    namespace: str, admin_schema: schemathesis.BaseSchema
) -> None:
    operations = [result.ok() for result in admin_schema.get_all_operations()]
    assert len(operations) >= 8
    refused: list[tuple[str, str]] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
        def never_a_server_error(case: schemathesis.Case) -> None:
            writes = case.method.upper() in WRITES  # a refused read has nothing to change
            before = state_of(namespace) if writes else None
            response = case.call(headers=AUTH)
            assert response.status_code < 500, (case.method, case.path, response.text)
            if 400 <= response.status_code < 500 and before is not None:
                assert state_of(namespace) == before, (case.method, case.path, response.text)
                refused.append((case.method, case.path))
            if case.path in PUBLIC:
                return
            before = state_of(namespace) if writes else None
            unauthorized = case.call(headers={"Authorization": "Bearer wrong"})
            assert unauthorized.status_code == 401, (case.method, case.path)
            assert TOKEN not in unauthorized.text
            if before is not None:
                assert state_of(namespace) == before, (case.method, case.path, "401")

        never_a_server_error()
    # The comparison ran on refused writes, not only on reads.
    assert {m for m, _ in refused} >= {"PATCH", "POST", "PUT"}, sorted(set(refused))


BAD_CALLS = [
    ("PATCH", "/config", {"prefix_length": 0}, 422),
    ("PATCH", "/config", {"prefix_length": 2**40}, 422),
    ("PATCH", "/config", {"prefix_mode": "tokens"}, 422),
    ("PATCH", "/config", {"no_such_setting": 1}, 422),
    ("PATCH", "/config", {"health_check": {"interval_ms": -1}}, 422),
    ("PATCH", "/config", [1, 2], 422),
    ("PUT", "/config", {"prefix_length": "long"}, 422),
    ("POST", "/instances", {"address": "", "port": 8000}, 422),
    ("POST", "/instances", {"address": "127.0.0.1", "port": 0}, 422),
    ("POST", "/instances", {"address": "127.0.0.1", "port": 8000, "weight": 0}, 422),
    ("POST", "/instances", {"address": "127.0.0.1", "port": 9}, 409),  # already there
    ("PATCH", "/instances/127.0.0.1:9", {"weight": 129}, 422),
    ("PATCH", "/instances/127.0.0.1:9", {"state": "gone"}, 422),
    ("PATCH", "/instances/10.9.9.9:1", {"weight": 2}, 404),
    ("DELETE", "/instances/10.9.9.9:1", None, 404),
    ("POST", "/instances/10.9.9.9:1/drain", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "code"), BAD_CALLS)
def test_a_refused_call_says_why_and_changes_nothing(
    admin_url: str, namespace: str, method: str, path: str, body: object, code: int
) -> None:
    before = state_of(namespace)
    assert before is not None  # the table makes no change that starts a drain
    with httpx.Client(base_url=admin_url, headers=AUTH, timeout=10) as admin:
        response = admin.request(method, path, json=body)
        malformed = (
            admin.request(
                method, path, content=b"{not json", headers={"content-type": "application/json"}
            )
            if body is not None
            else None
        )
    assert response.status_code == code, response.text
    assert response.json()["detail"], response.text  # a reason, not only a code
    if malformed is not None:
        assert malformed.status_code == 422, malformed.text
    assert state_of(namespace) == before
