"""The admin API in process over real Redis: auth, validation, audit, draining, status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from control_plane.admin import create_app
from control_plane.drain import Drainer, drain_verdict
from control_plane.health import Streak, next_health, withhold_total_outage
from control_plane.server import resolve_token
from control_plane.service import AdminService
from prefix_router.core.config import HealthCheckConfig, RouterConfig
from prefix_router.core.errors import StartupError
from prefix_router.core.fleet import Fleet, Instance, InstanceState
from prefix_router.state.store import FleetRecord, StateStore
from tests.support.redis_ns import fresh_store

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
A = Instance("127.0.0.1", 9001)
B = Instance("127.0.0.1", 9002)


@dataclass
class Admin:
    client: httpx.AsyncClient
    store: StateStore
    service: AdminService


@pytest.fixture
async def admin() -> AsyncIterator[Admin]:
    async with fresh_store() as store:
        await store.seed(Fleet.of([A, B]), RouterConfig())
        service = AdminService(store, store)
        app = create_app(service, token=TOKEN)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://admin", headers=AUTH
        ) as client:
            yield Admin(client, store, service)


async def test_every_route_but_the_probe_needs_the_token(admin: Admin) -> None:
    c = admin.client
    routes = [
        ("GET", "/config"), ("PUT", "/config"), ("PATCH", "/config"), ("GET", "/instances"),
        ("POST", "/instances"), ("GET", f"/instances/{A.id}"), ("PATCH", f"/instances/{A.id}"),
        ("POST", f"/instances/{A.id}/drain"), ("DELETE", f"/instances/{A.id}"),
        ("GET", "/status"), ("GET", "/audit"), ("GET", "/openapi.json"), ("GET", "/docs"),
    ]  # fmt: skip
    for method, path in routes:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            r = await c.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (method, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    assert (await c.get("/healthz", headers={"Authorization": ""})).status_code == 200
    assert (await admin.store.read()).versions == (1, 1)
    assert await admin.store.audit_log() == []


async def test_openapi_docs_are_served(admin: Admin) -> None:
    spec = (await admin.client.get("/openapi.json")).json()
    assert {"/config", "/instances", "/instances/{instance_id}", "/status"} <= set(spec["paths"])
    assert "swagger" in (await admin.client.get("/docs")).text.lower()


@pytest.mark.parametrize(
    ("method", "body", "reason"),
    [
        ("PATCH", {"prefix_length": 0}, "prefix_length"),
        ("PATCH", {"prefix_mode": "tokens"}, "prefix_mode"),
        ("PATCH", {"no_such_setting": 1}, "no_such_setting"),
        ("PATCH", {"health_check": {"interval_ms": 1}}, "health_check.interval_ms"),
        ("PUT", {"prefix_length": -5}, "prefix_length"),
        # what Envoy could not take: the snapshot would never publish, or be NACKed
        ("PATCH", {"circuit_breakers": {"max_requests": 2**32}}, "circuit_breakers.max_requests"),
        ("PATCH", {"health_check": {"path": "health"}}, "health_check.path"),
        ("PATCH", {"health_check": {"path": "/a\nb"}}, "health_check.path"),
        ("PATCH", {"retry": {"retry_on": "connect-failure,5xxx"}}, "5xxx"),
    ],
)
async def test_invalid_config_is_422_with_the_reason_and_nothing_changes(
    admin: Admin, method: str, body: dict[str, object], reason: str
) -> None:
    before = await admin.client.get("/config")
    r = await admin.client.request(method, "/config", json=body)
    assert r.status_code == 422
    assert reason in r.json()["detail"]
    assert (await admin.client.get("/config")).json() == before.json()
    assert await admin.store.audit_log() == []


async def test_a_config_change_is_versioned_and_audited(admin: Admin) -> None:
    r = await admin.client.patch("/config", json={"prefix_length": 64, "spill": {"load_factor": 2}})
    assert r.status_code == 200
    assert r.json()["version"] == 2
    assert r.json()["config"]["prefix_length"] == 64
    assert r.json()["config"]["spill"]["policy"] == "least-work"  # nested merge kept it
    r = await admin.client.put("/config", json={"prefix_mode": "bytes"})
    assert r.json()["version"] == 3
    assert r.json()["config"]["prefix_length"] == RouterConfig().prefix_length  # PUT replaces
    put, patch = await admin.store.audit_log()
    assert patch["action"] == "patch-config" and patch["actor"] == "admin"
    assert patch["before"]["prefix_length"] == 32768 and patch["after"]["prefix_length"] == 64
    assert put["action"] == "put-config" and put["after"]["prefix_mode"] == "bytes"
    assert put["time"] >= patch["time"] > 0


async def test_instances_add_update_and_their_errors(admin: Admin) -> None:
    c = admin.client
    r = await c.post("/instances", json={"address": "10.1.1.1", "port": 80, "weight": 2,
                                         "models": ["m1"]})  # fmt: skip
    assert r.status_code == 201
    assert r.json()["fleet_version"] == 2
    new_id = r.json()["instance"]["id"]
    assert (await c.post("/instances", json={"address": "10.1.1.1", "port": 80})).status_code == 409
    bad_bodies = [
        {"address": "", "port": 80},
        {"address": "h", "port": 70000},
        {"address": "h", "port": 1, "weight": 0},
        {"address": "h", "port": 1, "x": 1},
        {"address": "h", "port": 1, "models": ["has space"]},  # not a cluster name
        # no URL, probe or DNS lookup can use these
        {"address": "a:b", "port": 80},
        {"address": "a" * 64, "port": 80},
        {"address": "300.1.1.1", "port": 80},
        {"address": "host/path", "port": 80},
    ]
    for bad in bad_bodies:
        r = await c.post("/instances", json=bad)
        assert r.status_code == 422, bad
        assert r.json()["detail"]
    r = await c.patch(f"/instances/{new_id}", json={"weight": 5, "models": ["m2"]})
    assert r.json()["instance"]["weight"] == 5 and r.json()["instance"]["models"] == ["m2"]
    assert (await c.patch(f"/instances/{new_id}", json={"weight": 999})).status_code == 422
    assert (await c.patch(f"/instances/{new_id}", json={"models": [""]})).status_code == 422
    for field in ("weight", "models", "state"):  # only hash_key can be cleared
        r = await c.patch(f"/instances/{new_id}", json={field: None})
        assert r.status_code == 422 and field in r.json()["detail"], r.text
    assert (await c.patch(f"/instances/{new_id}", json={"hash_key": None})).status_code == 200
    assert (await c.patch("/instances/nope:1", json={"weight": 2})).status_code == 404
    assert (await c.delete("/instances/nope:1")).status_code == 404
    listed = (await c.get("/instances")).json()
    assert [i["id"] for i in listed["instances"]] == sorted([A.id, B.id, new_id])
    assert listed["fleet_version"] == 3  # the refused calls wrote nothing
    actions = [e["action"] for e in await admin.store.audit_log()]
    assert actions == ["update-instance", "add-instance"]


async def test_drain_keeps_the_instance_and_active_undoes_it(admin: Admin) -> None:
    c = admin.client
    r = await c.post(f"/instances/{A.id}/drain")
    assert r.status_code == 202
    assert r.json()["instance"]["state"] == "draining"
    record = (await admin.store.read()).fleet
    assert [i.id for i in record.fleet.routable] == [B.id] and not record.removing
    r = await c.patch(f"/instances/{A.id}", json={"state": "active"})
    assert r.json()["instance"]["state"] == "active"
    assert r.json()["instance"]["draining_since"] is None


async def test_remove_drains_until_nothing_is_in_flight(admin: Admin) -> None:
    clock = [1000.0]
    admin.service.clock = lambda: clock[0]
    drainer = Drainer(admin.store, admin.store, grace_s=1.0, timeout_s=60.0, clock=lambda: clock[0])
    r = await admin.client.delete(f"/instances/{A.id}")
    assert r.status_code == 202 and r.json()["instance"]["state"] == "draining"
    await admin.store.redis.hset(admin.store.keys.inflight, A.id, 2)
    clock[0] += 5
    assert await drainer.sweep() == []  # two requests still in flight
    status = (await admin.client.get("/status")).json()
    [a] = [i for i in status["instances"] if i["id"] == A.id]
    assert (a["state"], a["in_flight"], a["removing"], a["routable"]) == (
        "draining",
        2,
        True,
        False,
    )
    await admin.store.redis.hset(admin.store.keys.inflight, A.id, 0)
    assert await drainer.sweep() == [A.id]
    record = (await admin.store.read()).fleet
    assert [i.id for i in record.fleet.instances] == [B.id] and not record.removing
    removed, requested = (await admin.store.audit_log())[:2]
    assert requested["action"] == "remove-instance" and requested["after"]["state"] == "draining"
    assert removed["actor"] == "drainer" and removed["after"] is None


async def test_status_reports_versions_and_instances(admin: Admin) -> None:
    status = (await admin.client.get("/status")).json()
    assert (status["fleet_version"], status["config_version"]) == (1, 1)
    assert [i["in_flight"] for i in status["instances"]] == [0, 0]
    assert status["xds_clients"] == []


def test_drain_verdict() -> None:
    draining = A.with_changes(state=InstanceState.DRAINING, draining_since=100.0)
    v = dict(grace_s=2.0, timeout_s=30.0)
    assert drain_verdict(A, 0, 200.0, **v) is None  # active: never
    assert drain_verdict(draining, 0, 101.0, **v) is None  # within grace
    assert drain_verdict(draining, 0, 102.0, **v) == "drained"
    assert drain_verdict(draining, 3, 110.0, **v) is None
    assert drain_verdict(draining, None, 110.0, **v) is None  # counts unknown
    assert drain_verdict(draining, 3, 130.0, **v) == "timeout"


def test_health_thresholds() -> None:
    cfg = HealthCheckConfig(unhealthy_threshold=2, healthy_threshold=3)
    assert next_health(True, Streak(ok=False, count=1), cfg) is True
    assert next_health(True, Streak(ok=False, count=2), cfg) is False
    assert next_health(False, Streak(ok=True, count=2), cfg) is False
    assert next_health(False, Streak(ok=True, count=3), cfg) is True


def test_the_last_healthy_instances_stay_up_when_every_probe_fails_at_once() -> None:
    a, b, c = (Instance("10.0.0.1", p) for p in (1, 2, 3))
    fleet = Fleet.of([a, b, c.with_changes(healthy=False)])
    assert withhold_total_outage(fleet, {a.id: False}) == {a.id: False}
    assert withhold_total_outage(fleet, {a.id: False, b.id: False}) == {}
    assert withhold_total_outage(fleet, {a.id: False, b.id: False, c.id: True}) == {
        a.id: False,
        b.id: False,
        c.id: True,
    }
    # The last healthy one stays up; with none healthy, instances still come back.
    last = Fleet.of([a.with_changes(healthy=False), b])
    assert withhold_total_outage(last, {b.id: False}) == {}
    down = Fleet.of([a.with_changes(healthy=False), b.with_changes(healthy=False)])
    assert withhold_total_outage(down, {a.id: True}) == {a.id: True}
    # A draining instance's health does not count as keeping the fleet up.
    draining = Fleet.of([a, b.with_changes(state=InstanceState.DRAINING)])
    assert withhold_total_outage(draining, {a.id: False}) == {}


def test_a_token_is_required_off_loopback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PREFIX_ROUTER_ADMIN_TOKEN", raising=False)
    assert resolve_token(None, "127.0.0.1") is None
    assert resolve_token(None, "::1") is None
    with pytest.raises(StartupError, match="needs a token"):
        resolve_token(None, "0.0.0.0")
    monkeypatch.setenv("PREFIX_ROUTER_ADMIN_TOKEN", "from-env")
    assert resolve_token(None, "0.0.0.0") == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert resolve_token(str(token_file), "0.0.0.0") == "from-file"


async def test_an_instance_cannot_take_a_ring_key_another_one_has(admin: Admin) -> None:
    """Equal ring keys put equal hashes on Envoy's ring, and which instance owns them is
    then up to Envoy's sort: ext_proc could not mirror it, so the API refuses them."""
    c = admin.client
    r = await c.post("/instances", json={"address": "10.0.0.1", "port": 80, "hash_key": "gpu-a"})
    assert r.status_code == 201
    taken = [
        {"address": "10.0.0.2", "port": 80, "hash_key": "gpu-a"},  # the same hash_key
        {"address": "10.0.0.2", "port": 80, "hash_key": B.id},  # another instance's id
    ]
    for body in taken:
        r = await c.post("/instances", json=body)
        assert r.status_code == 409, body
        assert "same ring key" in r.json()["detail"]
    r = await c.patch(f"/instances/{B.id}", json={"hash_key": "gpu-a"})
    assert r.status_code == 409 and "same ring key" in r.json()["detail"]
    fleet = (await admin.store.read()).fleet.fleet
    assert sorted(i.ring_key for i in fleet.instances) == sorted([A.id, B.id, "gpu-a"])
    # a key of its own, and the instance's own key given again, are both fine
    assert (await c.patch(f"/instances/{B.id}", json={"hash_key": "gpu-b"})).status_code == 200
    assert (await c.patch(f"/instances/{B.id}", json={"hash_key": "gpu-b"})).status_code == 200


async def test_a_successor_takes_the_ring_key_of_an_instance_draining_away(admin: Admin) -> None:
    """docs/deployment.md's replacement of a pod without a stable name: the old address
    is removed (it drains, still in the fleet, on no ring) and the new one added with the
    same hash_key. Bringing the old one back to active would then share the key: refused."""
    c = admin.client
    old = {"address": "10.0.12.7", "port": 8000, "hash_key": "vllm-0"}
    assert (await c.post("/instances", json=old)).status_code == 201
    assert (await c.delete("/instances/10.0.12.7:8000")).status_code == 202
    new = {"address": "10.0.12.9", "port": 8000, "hash_key": "vllm-0"}
    assert (await c.post("/instances", json=new)).status_code == 201
    back = await c.patch("/instances/10.0.12.7:8000", json={"state": "active"})
    assert back.status_code == 409 and "same ring key" in back.json()["detail"]


async def test_an_ip_added_through_the_api_is_written_as_envoy_writes_it(admin: Admin) -> None:
    r = await admin.client.post("/instances", json={"address": "FD00:0::7", "port": 8000})
    assert r.status_code == 201 and r.json()["instance"]["id"] == "[fd00::7]:8000"


async def test_a_collision_written_before_the_check_blocks_nothing_unrelated(
    admin: Admin,
) -> None:
    """Two active instances sharing a hash_key (written before ring keys were checked):
    adding another instance, or draining and re-activating an unrelated one, still works;
    only a change that would make a collision of its own is refused."""

    def collide(record: FleetRecord) -> FleetRecord:
        twins = [Instance("10.0.0.1", 80, hash_key="dup"), Instance("10.0.0.2", 80, hash_key="dup")]
        return FleetRecord(Fleet.of([*record.fleet.instances, *twins]), record.removing)

    await admin.store.update_fleet(collide)
    c = admin.client
    assert (await c.post("/instances", json={"address": "10.0.0.3", "port": 80})).status_code == 201
    assert (await c.post(f"/instances/{A.id}/drain")).status_code == 202
    assert (await c.patch(f"/instances/{A.id}", json={"state": "active"})).status_code == 200
    taken = await c.post("/instances", json={"address": "10.0.0.4", "port": 80, "hash_key": "dup"})
    assert taken.status_code == 409
