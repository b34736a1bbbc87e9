"""``prefix-router up`` survives any one of its processes dying: each is SIGKILLed under load.

One real stack for the module, as a user starts it (its own Redis, simulated vLLM, the
control plane, one ext_proc, Envoy). For each component in turn: light load through
Envoy, SIGKILL, and then:

* requests failed only while the component was down: each failure overlaps the span
  from the kill to the moment the supervisor reported it back, and every request sent
  after that succeeded;
* the stack is whole again: requests are routed by ext_proc with the fleet-wide counts
  in Redis (decisions counted ``home``/``placed``/``spilled``, not ``ring_only``), the fleet and
  config are as before (a Redis restarted empty gets them back from the control plane),
  in-flight counts return to 0 and never go below it;
* the restart is visible: up's output names the exit status and shows the log's last
  lines, the status page's data (``GET /fleet``) has the event, and the control plane's
  metrics count the restart.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import psutil
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.ops.procs import free_port
from tests.support.figures import report
from tests.support.load import Load
from tests.support.processes import UpProcess, banner_value, clean_env

pytestmark = pytest.mark.e2e

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
TOKEN = "supervision-test-token"
T = TypeVar("T")


def wait_for(probe: Callable[[], T | None], what: str, timeout: float = 90.0) -> T:
    """``probe()`` until it returns something other than ``None``/``False``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = probe()
        except (httpx.HTTPError, redis.RedisError, OSError):
            value = None
        if value is not None and value is not False:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Stack:
    up: UpProcess
    port: int
    admin_port: int
    redis_url: str
    namespace: str
    ext_proc_metrics: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def admin(self, path: str) -> httpx.Response:
        return httpx.get(
            f"http://127.0.0.1:{self.admin_port}{path}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        )

    def fleet(self) -> dict[str, Any]:
        r = self.admin("/fleet")
        r.raise_for_status()
        return dict(r.json())

    def components(self) -> dict[str, dict[str, Any]]:
        """Each process in up's report; none for the moment after Redis restarted empty,
        until up writes its report again."""
        report = self.fleet()["supervision"] or {"components": []}
        return {c["name"]: c for c in report["components"]}

    def metrics(self) -> dict[tuple[str, str], float]:
        text = self.admin("/metrics").text
        return {
            (sample.name, sample.labels.get("component", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def decisions(self) -> dict[str, float]:
        """ext_proc's own count of decisions by outcome (reset when it restarts)."""
        text = httpx.get(self.ext_proc_metrics, timeout=5).text
        return {
            sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "prefix_router_ext_proc_decisions_total"
        }

    def in_flight(self) -> dict[str, int]:
        client = redis.Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            raw = client.hgetall(f"{self.namespace}inflight")
        finally:
            client.close()
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    def chat(self) -> int:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=10).status_code


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("supervised")
    ports = {n: free_port() for n in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    namespace = f"test-sup-{uuid.uuid4().hex[:8]}:"
    args = [
        "--run-dir",
        str(tmp / "run"),
        "--instances",
        "2",
        "--ext-procs",
        "1",
        "--envoy-concurrency",
        "1",
        "--sim-time-scale",
        "50",
        "--namespace",
        namespace,
        "--admin-token",
        TOKEN,
        *(arg for name, port in ports.items() for arg in (f"--{name}", str(port))),
    ]
    with UpProcess(args, tmp / "up.out", env=clean_env()) as up:  # its own Redis
        banner = up.wait_up()
        yield Stack(
            up,
            ports["port"],
            ports["admin-port"],
            banner_value(banner, "Redis"),
            namespace,
            re.findall(r"(http://\S+/metrics) \(ext_proc\)", banner)[0],
        )
        assert up.terminate() == 0
        assert up.leftovers() == []


COMPONENTS = ["envoy", "ext_proc-0", "control-plane", "vllm-sim", "redis"]


@pytest.mark.parametrize("name", COMPONENTS)
def test_a_component_killed_under_load_is_restarted_and_the_stack_is_whole(
    stack: Stack, name: str
) -> None:
    before = wait_for(lambda: stack.components().get(name), f"{name} in the report")
    assert before["state"] == "running"
    state_before = {k: stack.fleet()[k] for k in ("fleet_version", "config_version")}
    pid = before["pid"]
    assert pid in stack.up.track()  # one of up's own processes, not anybody's

    with Load(stack.url, workers=2, model=MODEL, max_tokens=4) as load:
        wait_for(lambda: sum(o.status == 200 for o in load.outcomes) >= 5, "load flowing")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def restarted() -> dict[str, Any] | None:
            now = stack.components().get(name, {})
            back = now.get("restarts") == before["restarts"] + 1 and now["state"] == "running"
            return now if back else None

        after = wait_for(restarted, f"{name} restarted and serving")
        back = time.monotonic()
        assert after["pid"] != pid and after["last_exit"] == "killed by SIGKILL"
        wait_for(
            lambda: sum(o.started > back and o.status == 200 for o in load.outcomes) >= 10,
            "requests served after the restart",
        )
    stack.up.track()

    report(
        f"{name} SIGKILLed under load (up)",
        requests=len(load.outcomes),
        failed=len(load.failures()),
        back_after_s=f"{back - killed:.2f} (as polled)",
    )
    # failures only during the gap; everything sent after the restart succeeded
    assert [o for o in load.failures() if o.ended < killed or o.started > back] == []
    assert all(o.status == 200 for o in load.outcomes if o.started > back)

    # whole again: routed by ext_proc with fleet-wide counts, same fleet and config
    counted = stack.decisions()
    wait_for(lambda: stack.chat() == 200 and stack.decisions() != counted, "a routed request")
    wait_for(
        lambda: (
            stack.chat() == 200
            and sum(stack.decisions().get(o, 0) for o in ("home", "placed", "spilled"))
            > sum(counted.get(o, 0) for o in ("home", "placed", "spilled"))
        ),
        "a decision counted in Redis",
    )
    # (after Redis restarted empty, the control plane writes them back within a second)
    wait_for(
        lambda: {k: stack.fleet()[k] for k in state_before} == state_before,
        "the fleet and config as before",
    )
    assert all(i["routable"] for i in stack.fleet()["instances"])
    wait_for(lambda: set(stack.in_flight().values()) <= {0}, "in-flight counts back to 0")

    # visible: up's output, the status page's data, the metrics
    output = stack.up.output()
    assert f"{name} (pid {pid}) exited unexpectedly: killed by SIGKILL" in output
    assert re.search(rf"{re.escape(name)} is back \(pid {after['pid']}, restart", output)
    events = stack.fleet()["supervision"]["events"]
    [exit_event] = [e for e in events if e["kind"] == "exit" and e["pid"] == pid]
    assert exit_event["component"] == name and exit_event["status"] == "killed by SIGKILL"
    assert exit_event["log_tail"]  # the last lines of its log
    metrics = wait_for(
        lambda: (
            m
            if (m := stack.metrics()).get(
                ("prefix_router_control_plane_component_restarts_total", name)
            )
            == after["restarts"]
            else None
        ),
        "the restart counted",
    )
    assert metrics[("prefix_router_control_plane_component_up", name)] == 1
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
