"""Property-based API testing of the admin API from its own OpenAPI schema (schemathesis):
whatever the input, never a 5xx. Against a real control-plane process and real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from prefix_router.ops.launch import start_module
from prefix_router.ops.procs import free_port
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.redis_ns import fresh_store, unique_namespace

pytestmark = pytest.mark.e2e

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PUBLIC = {"/healthz", "/metrics", "/ui", "/status/page"}
"""Routes that need no token: the health probe, Prometheus scrapes, the page shell."""


@pytest.fixture(scope="module")
def admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    namespace = unique_namespace()
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


def test_no_input_makes_the_admin_api_fail(admin_schema: schemathesis.BaseSchema) -> None:
    operations = [result.ok() for result in admin_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
        def never_a_server_error(case: schemathesis.Case) -> None:
            response = case.call(headers=AUTH)
            assert response.status_code < 500, (case.method, case.path, response.text)
            if case.path in PUBLIC:
                return
            unauthorized = case.call(headers={"Authorization": "Bearer wrong"})
            assert unauthorized.status_code == 401, (case.method, case.path)
            assert TOKEN not in unauthorized.text

        never_a_server_error()
