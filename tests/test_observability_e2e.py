"""Observability end to end on the running stack: one request id through Envoy's access log,
ext_proc and the backend; Envoy's stats (the ones docs/observability.md says to alert on) on its
admin interface, including ext_proc's failure-mode-allowed counter."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.core.config import RouterConfig
from tests.conftest import ProcessReaper
from tests.support.running_stack import RunningStack, running_stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def json_lines(path: Path) -> list[dict[str, Any]]:
    entries = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return entries


def logged(path: Path, **fields: Any) -> dict[str, Any] | None:
    """The first JSON log line of ``path`` with all of ``fields``."""
    return next(
        (e for e in json_lines(path) if all(e.get(k) == v for k, v in fields.items())), None
    )


def in_flight(admin: httpx.Client) -> int:
    """Fleet-wide requests in flight, as the control plane reads them from Redis."""
    return sum(i["in_flight"] or 0 for i in admin.get("/status").json()["instances"])


def test_one_request_id_through_envoy_ext_proc_and_the_backend(
    procs: ProcessReaper, tmp_path: Path
) -> None:
    config = RouterConfig.model_validate({"concurrency_threshold": 1})
    with running_stack(procs, tmp_path, instances=2, sim_time_scale=1.0, config=config) as stack:
        logs = stack.log_dir
        # the same long prompt twice, the second sent once the first is counted in flight:
        # the first is then still in its prefill (6,500 tokens, 0.8 s at the default rate),
        # so its holder is at the threshold: the second spills
        responses: list[httpx.Response] = []

        def send() -> None:
            with httpx.Client(timeout=60) as client:
                responses.append(stack.chat(client, "Same prompt. " * 2000, max_tokens=60))

        threads = [threading.Thread(target=send) for _ in range(2)]
        with stack.admin() as admin:
            for started, t in enumerate(threads, 1):
                t.start()
                # the next one is routed only once this one is counted (or done)
                wait_until(lambda n=started: in_flight(admin) + len(responses) >= n, 30,
                           "the request is counted in flight")  # fmt: skip
        for t in threads:
            t.join()
        assert [r.status_code for r in responses] == [200, 200]
        ids = [r.headers["x-request-id"] for r in responses]  # echoed by the backend
        assert len(set(ids)) == 2 and all(re.fullmatch(r"[0-9a-f-]{36}", i) for i in ids)

        with stack.admin() as admin:
            spills = admin.get("/fleet").json()["spills"]
        assert len(spills) == 1, spills
        spill = spills[0]
        spilled = next(r for r in responses if r.headers["x-request-id"] == spill["request_id"])
        # the backend that answered it is the one ext_proc spilled it to
        assert spill["to"].endswith(":" + spilled.headers["x-sim-instance"])

        envoy_log = logs / "envoy.log"
        for response in responses:
            rid = response.headers["x-request-id"]
            wait_until(lambda rid=rid: logged(envoy_log, request_id=rid), 30, f"Envoy logs {rid}")
            entry = logged(envoy_log, request_id=rid)
            assert entry is not None
            assert entry["status"] == 200 and entry["path"] == "/v1/chat/completions"
            assert entry["upstream"].endswith(":" + response.headers["x-sim-instance"])
        ext_proc = logged(
            logs / "ext_proc-0.log", request_id=spill["request_id"], outcome="spilled"
        )
        assert ext_proc is not None and ext_proc["instance"] == spill["to"]
        assert ext_proc["component"] == "ext_proc"

        # an id the client sends is kept, end to end
        with httpx.Client(timeout=30) as client:
            mine = stack.chat(client, "hi", headers={"x-request-id": "client-chosen-id-1"})
        assert mine.status_code == 200 and mine.headers["x-request-id"] == "client-chosen-id-1"
        wait_until(lambda: logged(envoy_log, request_id="client-chosen-id-1"), 30, "Envoy logs it")


def documented_envoy_stats() -> list[tuple[str, str, dict[str, str]]]:
    """(``/stats`` name, Prometheus name, labels) from the docs' table."""
    body = DOCS.read_text().split("<!-- envoy-stats:begin -->")[1].split("<!-- envoy-stats:end")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        name, _, labels = cells[1].partition("{")
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        rows.append((cells[0], name, pairs))
    return rows


def envoy_stats(stack: RunningStack) -> dict[str, str]:
    text = httpx.get(f"{stack.envoy_admin_url}/stats", timeout=5).text
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def envoy_prometheus(stack: RunningStack) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{stack.envoy_admin_url}/stats/prometheus", timeout=5).text
    return [  # family names: the parser gives counters' samples a _total Envoy does not print
        (family.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def test_envoy_stats_worth_alerting_on_are_on_its_admin_interface(
    procs: ProcessReaper, tmp_path: Path
) -> None:
    with running_stack(procs, tmp_path, instances=2) as stack, httpx.Client(timeout=30) as client:
        assert stack.chat(client, "before").status_code == 200
        assert int(envoy_stats(stack)["http.data_plane.ext_proc.failure_mode_allowed"]) == 0

        # ext_proc gone: requests still succeed, and Envoy counts them as failure-mode-allowed
        stack.process("ext_proc-0").stop()
        for i in range(3):
            assert stack.chat(client, f"without ext_proc {i}").status_code == 200
        stats = envoy_stats(stack)
        assert int(stats["http.data_plane.ext_proc.failure_mode_allowed"]) >= 3
        assert int(stats["cluster.ext_proc.upstream_cx_connect_fail"]) >= 1

        # every instance failing: clients see the 5xx and so does the models cluster's count
        for instance in stack.instance_ids:
            r = client.post(f"http://{instance}/sim/fault", json={"mode": "unhealthy"})
            assert r.status_code == 200, r.text
        assert stack.chat(client, "all instances failing").status_code == 503
        stats = envoy_stats(stack)
        assert int(stats["cluster.models.upstream_rq_5xx"]) >= 1

        samples = envoy_prometheus(stack)
        documented = documented_envoy_stats()
        assert documented, "docs/observability.md documents no Envoy stat"
        for stat, name, labels in documented:
            assert stat in stats, f"{stat} is not in Envoy's /stats"
            assert any(n == name and labels.items() <= got.items() for n, got, _ in samples), (
                f"{name}{labels} is not in Envoy's /stats/prometheus"
            )
        allowed = [
            v
            for n, got, v in samples
            if n == "envoy_http_ext_proc_failure_mode_allowed"
            and got.get("envoy_http_conn_manager_prefix") == "data_plane"
        ]
        assert allowed and allowed[0] >= 3
