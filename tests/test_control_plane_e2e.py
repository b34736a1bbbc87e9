"""The control plane end to end: real Envoy over ADS, real Redis, ext_proc following Redis.

Each test starts echo backends, the control plane (``prefix-router control-plane``),
one ext_proc with ``--redis-url`` and Envoy with an xDS bootstrap, on free ports.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from prefix_router.core.config import PrefixMode, RouterConfig
from prefix_router.core.fleet import Fleet
from prefix_router.core.key import KeySettings, extract_key
from prefix_router.core.ring import Ring
from tests.conftest import ProcessReaper
from tests.support.load import Load, Outcome
from tests.support.wait import async_wait_until, wait_until
from tests.support.xds_stack import TOKEN, XdsStack, start_xds_stack, tables_applied

pytestmark = pytest.mark.e2e


def chat(content: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def prefix_key_seen(client: httpx.Client, stack: XdsStack, body: bytes) -> str:
    r = client.post(f"{stack.url}/v1/chat/completions", content=body)
    assert r.status_code == 200, r.text
    return str(r.json()["prefix_key"])


def test_instances_join_and_leave_under_load_without_a_failed_request(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    stack, _ = start_xds_stack(
        procs, log_dir, namespace, backends=2, spare_backends=1,
        extra_cp_args=["--drain-grace", "1.0"],
    )  # fmt: skip
    old, new = str(stack.backend_ports[0]), str(stack.backend_ports[2])
    with stack.admin() as admin, Load(stack.url) as load:
        wait_until(lambda: len(load.outcomes) >= 20, 30, "the load runs")
        asked = time.monotonic()
        r = admin.post("/instances", json={"address": "127.0.0.1", "port": int(new)})
        assert r.status_code == 201, r.text
        wait_until(lambda: load.first_from(new, asked) is not None, 30, "the new instance serves")
        wait_until(stack.converged, 30, "Envoy and ext_proc run the fleet of 3")
        settled_at = time.monotonic()
        wait_until(lambda: len(started_after(load, settled_at)) > 50, 30, "50 requests on it")
        # ext_proc's ring mirror is Envoy's ring: the header it set picks the instance served.
        fleet = Fleet.from_json_dict(admin.get("/instances").json())
        ring = Ring.build(fleet.routable, minimum_ring_size=256 * 3)
        for o in started_after(load, settled_at):
            picked = ring.pick(o.prefix_key or "")
            assert picked is not None and str(picked.port) == o.backend, o

        removing = time.monotonic()
        r = admin.delete(f"/instances/127.0.0.1:{old}")
        assert r.status_code == 202 and r.json()["instance"]["state"] == "draining"
        wait_until(stack.converged, 30, "Envoy and ext_proc run the fleet without it")
        drained_at = time.monotonic()
        wait_until(
            lambda: f"127.0.0.1:{old}" not in stack.envoy_hosts(), 30, "Envoy dropped the instance"
        )
        gone = time.monotonic()
        wait_until(lambda: len(started_after(load, drained_at)) > 50, 30, "50 requests after")
    assert load.served_by(old, after=0) > 0  # it did serve before
    assert load.served_by(old, after=drained_at) == 0, "no new request after draining"
    assert gone - removing >= 1.0  # the drain grace held it until nothing could be in flight
    assert load.failures() == [], load.failures()[:5]
    with stack.admin() as admin:
        status = admin.get("/status").json()
        assert [i["port"] for i in status["instances"]] == sorted(stack.backend_ports[1:])
        actions = [e["action"] for e in admin.get("/audit").json()]
        assert actions[:3] == [
            "remove-instance (drained, in flight 0)", "remove-instance", "add-instance"
        ]  # fmt: skip


def started_after(load: Load, moment: float) -> list[Outcome]:
    return [o for o in load.outcomes if o.started > moment]


def test_config_changes_reach_every_ext_proc_replica_and_envoy_and_bad_ones_change_nothing(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    """Two ext_proc replicas behind one Envoy: each follows every config change (the README's
    "every ext_proc replica follows"); refused changes reach neither them nor Envoy."""
    config = RouterConfig.model_validate({"spill": {"policy": "none"}})  # keys, not steering
    stack, _ = start_xds_stack(procs, log_dir, namespace, backends=2, ext_procs=2, config=config)
    body = chat("same prompt " * 10)
    with stack.admin() as admin, httpx.Client(timeout=10) as client:
        # No token, wrong token: 401, from the real process.
        for token in (None, "wrong"):
            with stack.admin(token=token) as intruder:
                assert intruder.get("/config").status_code == 401
                assert intruder.patch("/config", json={"prefix_length": 8}).status_code == 401
        wait_until(stack.converged, 30, "both replicas and Envoy run the first state")
        before_key = prefix_key_seen(client, stack, body)
        before = admin.get("/config").json()
        assert cds_acked(admin) == "1.1"
        started_with = [tables_applied(p) for p in stack.ext_procs]
        assert started_with == [[(1, 1)], [(1, 1)]]

        # PrefixLength 0, an unknown mode: 422, nothing changes anywhere.
        for bad in ({"prefix_length": 0}, {"prefix_mode": "tokens"}):
            r = admin.patch("/config", json=bad)
            assert r.status_code == 422 and next(iter(bad)) in r.json()["detail"]
        assert admin.get("/config").json() == before
        assert cds_acked(admin) == "1.1"
        assert prefix_key_seen(client, stack, body) == before_key

        # A valid change reaches both replicas (and no refused one ever reached them: each
        # replica's tables go from config 1 straight to config 2).
        settings = KeySettings(prefix_length=8, mode=PrefixMode.BYTES)
        expected = extract_key(body, settings=settings, path="/v1/chat/completions", tenant="")
        r = admin.patch("/config", json={"prefix_length": 8, "prefix_mode": "bytes"})
        assert r.status_code == 200 and r.json()["version"] == before["version"] + 1
        wait_until(stack.converged, 30, "both replicas and Envoy run config 2")
        assert [tables_applied(p) for p in stack.ext_procs] == [[(1, 1), (1, 2)]] * 2
        assert cds_acked(admin) == "1.2"
        # Envoy spreads streams over both replicas: every request is keyed the new way.
        assert {prefix_key_seen(client, stack, body) for _ in range(20)} == {expected.value}

        # A config Envoy would NACK (an empty health-check path) is refused by the API and
        # never reaches Envoy (a NACK's report: test_control_plane_xds.py).
        r = admin.patch("/config", json={"health_check": {"path": ""}})
        assert r.status_code == 422 and "health_check.path" in r.json()["detail"]
        assert nack_of(admin) is None
        assert cds_acked(admin) == "1.2"
        assert health_path(stack) == "/health"

        # The next good config is applied.
        r = admin.patch("/config", json={"health_check": {"path": "/ready"}})
        wait_until(lambda: health_path(stack) == "/ready", 30, "Envoy runs the new cluster")
        assert nack_of(admin) is None
        assert cds_acked(admin) == f"1.{r.json()['version']}"


def cds_acked(admin: httpx.Client) -> str:
    [client] = admin.get("/status").json()["xds_clients"]
    return str(client["acked"].get("cds"))


def nack_of(admin: httpx.Client) -> dict[str, str] | None:
    [client] = admin.get("/status").json()["xds_clients"]
    nack: dict[str, str] | None = client["nacked"].get("cds")
    return nack


def health_path(stack: XdsStack) -> str:
    cluster = stack.envoy_cluster()
    assert cluster is not None
    return str(cluster["cluster"]["health_checks"][0]["http_health_check"]["path"])


def test_several_envoys_follow_and_reconnect_after_a_control_plane_restart(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    stack, envoys = start_xds_stack(procs, log_dir, namespace, backends=2, envoy_nodes=2)
    with stack.admin() as admin:
        wait_until(lambda: acked(admin) == {"envoy-0": "1.1", "envoy-1": "1.1"}, 30, "both ACK")
        assert stack.control_plane is not None
        stack.control_plane.stop()
        wait_until(lambda: not stack.control_plane_connected(), 30, "Envoy saw it go")
        # Envoy keeps serving on its last config while the control plane is away.
        assert httpx.post(f"{stack.url}/v1/chat/completions", content=chat("x")).status_code == 200
        stack.start_control_plane(procs)
        wait_until(lambda: acked(admin) == {"envoy-0": "1.1", "envoy-1": "1.1"}, 30,
                   "both Envoys reconnect and ACK the same state")  # fmt: skip
        r = admin.patch(f"/instances/127.0.0.1:{stack.backend_ports[0]}", json={"weight": 3})
        assert r.status_code == 200
        wait_until(lambda: acked(admin) == {"envoy-0": "2.1", "envoy-1": "2.1"}, 30, "2.1 ACKed")
        weights = {h: s["weight"] for h, s in stack.envoy_hosts().items()}
        assert weights[f"127.0.0.1:{stack.backend_ports[0]}"] == 3


def acked(admin: httpx.Client) -> dict[str, str]:
    clients = admin.get("/status").json()["xds_clients"]
    return {c["node_id"]: c["acked"].get("eds", "") for c in clients if c["connected"]}


def test_an_instance_named_by_dns_is_published_by_ip_and_routed_where_the_mirror_says(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    stack, _ = start_xds_stack(procs, log_dir, namespace, backends=2, spare_backends=1)
    named = stack.backend_ports[2]
    with stack.admin() as admin, httpx.Client(timeout=10) as client:
        r = admin.post("/instances", json={"address": "localhost", "port": named})
        assert r.status_code == 201, r.text
        wait_until(lambda: f"127.0.0.1:{named}" in stack.envoy_hosts(), 30,
                   "Envoy got the name's IP over EDS")  # fmt: skip
        host = stack.envoy_hosts()[f"127.0.0.1:{named}"]
        assert host["hostname"] == f"localhost:{named}"
        fleet = Fleet.from_json_dict(admin.get("/instances").json())
        assert f"localhost:{named}" in {i.id for i in fleet.routable}
        ring = Ring.build(fleet.routable, minimum_ring_size=256 * 3)
        wait_until(stack.converged, 30, "Envoy and ext_proc run the fleet with the name")
        served: set[str] = set()
        for n in range(150):
            answer = client.post(f"{stack.url}/v1/chat/completions", content=chat(f"q{n} " * 8))
            assert answer.status_code == 200, answer.text
            picked = ring.pick(answer.json()["prefix_key"])
            assert picked is not None and str(picked.port) == answer.json()["backend"]
            served.add(answer.json()["backend"])
        assert str(named) in served and len(served) == 3


SIM_MODEL = "meta-llama/Llama-3.1-70B-Instruct"
STREAMED = 150  # ~20 ms a decode step at time scale 1: ~3 s of streaming


async def test_a_drain_lets_the_streams_in_flight_finish_then_removes_the_instance(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    """Three streamed generations on one simulated instance when its removal starts: new
    requests go elsewhere at once, the three stream to their last token, and the instance
    goes only once nothing is in flight on it (not at the drain timeout)."""
    stack, _ = start_xds_stack(
        procs, log_dir, namespace, backends=2, sim_args=["--time-scale", "1"],
        extra_cp_args=["--drain-grace", "0.5"],
    )  # fmt: skip
    prompt = "a long shared system prompt " * 20
    streamed = {
        "model": SIM_MODEL, "stream": True, "max_tokens": STREAMED, "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}],
    }  # fmt: skip
    url = f"{stack.url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        httpx.AsyncClient(base_url=stack.admin_url, headers=headers, timeout=30) as admin,
    ):
        streams = []
        try:
            for _ in range(3):
                request = client.build_request("POST", url, content=json.dumps(streamed))
                streams.append(await client.send(request, stream=True))
            lines = [r.aiter_lines() for r in streams]
            for it in lines:  # every generation has started (its role chunk came)
                assert (await anext(it)).startswith("data: {")
            homes = {r.headers["x-sim-instance"] for r in streams}
            assert len(homes) == 1, homes  # one prompt, one home
            home = f"127.0.0.1:{homes.pop()}"

            r = await admin.delete(f"/instances/{home}")
            assert r.status_code == 202 and r.json()["instance"]["state"] == "draining"
            status = (await admin.get("/status")).json()
            [draining] = [i for i in status["instances"] if f"127.0.0.1:{i['port']}" == home]
            assert draining["removing"] and draining["in_flight"] == 3, draining

            await asyncio.to_thread(wait_until, stack.converged, 30, "the drain reached all")
            short = {**streamed, "stream": False, "max_tokens": 1}
            for _ in range(5):  # the same prompt now goes to the other instance
                answer = await client.post(url, content=json.dumps(short))
                assert answer.status_code == 200
                assert f"127.0.0.1:{answer.headers['x-sim-instance']}" != home

            for response, it in zip(streams, lines, strict=True):
                rest = [line async for line in it if line.startswith("data: ")]
                assert response.status_code == 200
                assert rest[-1] == "data: [DONE]"
                tokens = [line for line in rest[:-1] if '"role"' not in line]
                assert len(tokens) == STREAMED, len(tokens)  # every token, to the last
        finally:
            for response in streams:
                await response.aclose()

        async def removed() -> bool:
            ids = [
                f"127.0.0.1:{i['port']}"
                for i in (await admin.get("/instances")).json()["instances"]
            ]
            return home not in ids

        await async_wait_until(removed, 30, "the drained instance is removed")
        audit = (await admin.get("/audit")).json()
        [removal] = [e for e in audit if e["target"] == home and e["actor"] == "drainer"]
        assert removal["action"] == "remove-instance (drained, in flight 0)", removal
