"""Security: the token is never echoed or logged, tenants never share a key, and the
data-plane listener serves neither the admin API nor Envoy's admin interface."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import ProcessReaper
from tests.support.xds_stack import TOKEN, start_xds_stack

pytestmark = pytest.mark.e2e


def test_security_properties_of_a_running_stack(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    stack, _ = start_xds_stack(procs, log_dir, namespace, backends=3)
    with httpx.Client(timeout=10) as client:
        # 1. No token, a wrong token, a near-miss token: 401, and the token is never echoed.
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            r = client.get(f"{stack.admin_url}/config", headers=headers)
            assert r.status_code == 401
            assert TOKEN not in r.text and TOKEN not in str(r.headers)
        ok = client.patch(
            f"{stack.admin_url}/config",
            json={"concurrency_threshold": 12},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert ok.status_code == 200
        assert TOKEN not in ok.text

        # 2. Two tenants sending the same prompt never share a key.
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "same"}]})
        keys = {
            client.post(
                f"{stack.url}/v1/chat/completions", content=body, headers={"x-tenant-id": t}
            ).json()["prefix_key"]
            for t in ("tenant-a", "tenant-b", "tenant-a")
        }
        assert len(keys) == 2

        # 3. The data-plane listener is not an admin surface: these paths go to a backend
        #    like any other request, never to Envoy's admin or the control plane.
        for path in ("/config", "/instances", "/status", "/stats", "/clusters", "/config_dump"):
            r = client.get(f"{stack.url}{path}")
            assert r.headers.get("x-backend"), path
            assert "cluster_statuses" not in r.text and "concurrency_threshold" not in r.text

    # 4. Nothing logged the token.
    assert stack.control_plane is not None
    logs = list(log_dir.glob("*.log"))
    assert logs, "no log to look in"
    for log in logs:
        assert TOKEN not in log.read_text(errors="replace"), log.name
