"""The control plane's fleet view, /fleet, /metrics and /ui in process, over real Redis.

Instances are simulated vLLM servers driven in process (httpx ASGITransport), plus
two over real HTTP on 127.0.0.1: a port nobody listens on, and the echo backend
(tests/support/echo_backend.py), whose JSON is not Prometheus text. The routing
store's keys are written by the real RedisStore.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from envoy.config.core.v3 import base_pb2
from prometheus_client.parser import text_string_to_metric_families

from control_plane.admin import create_app
from control_plane.callbacks import ClientRegistry
from control_plane.fleet_view import FleetView
from control_plane.metrics import METRIC_NAMES, PREFIX, ControlPlaneCollector, render, split_version
from control_plane.service import AdminService
from control_plane.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE
from prefix_router.core.config import RouterConfig
from prefix_router.core.decision import IN_FLIGHT_SLACK, Outcome
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.key import extract_key
from prefix_router.core.table import RoutingTable
from prefix_router.core.work import InstanceModel, model_of_text
from prefix_router.ops.launch import start_module
from prefix_router.ops.procs import free_port
from prefix_router.state.routing.redis_store import RedisStore
from prefix_router.state.store import StateStore
from prefix_router.state.supervision import write_report
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.redis_ns import fresh_store
from tests.support.supervision import REPORT
from vllm_sim import SimInstance, make_config
from vllm_sim import create_app as create_sim_app

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
A, B = Instance("127.0.0.1", 9101), Instance("127.0.0.1", 9102, weight=2)
PROMPT = "You are a careful assistant. " * 40


@dataclass
class Fleetside:
    store: StateStore
    view: FleetView
    sims: dict[str, SimInstance]
    client: httpx.AsyncClient
    """Talks to the instances (the same mounts the view scrapes through)."""
    down: Instance
    """Nothing listens on its port: connections are refused."""
    not_vllm: Instance
    """The echo backend: answers /metrics with JSON."""

    def ids(self) -> list[str]:
        """The fleet's instance ids, in the fleet's order."""
        return [i.id for i in Fleet.of([A, B, self.down, self.not_vllm]).instances]


@pytest.fixture
async def fleetside(procs: ProcessReaper, log_dir: Path) -> AsyncIterator[Fleetside]:
    sims = {i.id: SimInstance(make_config(time_scale=1e6), name=i.id) for i in (A, B)}
    mounts: dict[str, httpx.AsyncBaseTransport] = {
        f"http://{i}": httpx.ASGITransport(app=create_sim_app(s)) for i, s in sims.items()
    }
    down, not_vllm = Instance("127.0.0.1", free_port()), Instance("127.0.0.1", free_port())
    procs.add(
        start_module(
            "echo",
            "tests.support.echo_backend",
            [str(not_vllm.port)],
            log_dir,
            ready_ports=[not_vllm.port],
        )
    )
    async with fresh_store() as store, httpx.AsyncClient(mounts=mounts) as client:
        config = RouterConfig.model_validate({"concurrency_threshold": 1})
        await store.seed(Fleet.of([A, B, down, not_vllm]), config)
        # generous timeouts: a loaded CI machine must not turn a slow read into a failure
        view = FleetView(store, client=client, window_s=60.0, timeout_s=5.0, redis_timeout_s=5.0)
        try:
            yield Fleetside(store, view, sims, client, down, not_vllm)
        finally:
            for sim in sims.values():
                await sim.stop()


async def complete(client: httpx.AsyncClient, instance: Instance, prompt: str) -> None:
    body = {"model": make_config().model, "prompt": prompt, "max_tokens": 2}
    r = await client.post(f"http://{instance.id}/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def test_fleet_view_reads_every_instance_and_the_load_store(fleetside: Fleetside) -> None:
    f = fleetside
    await complete(f.client, A, PROMPT + "first")
    await f.view.tick()
    await complete(f.client, A, PROMPT + "second")  # shares a long prefix: hits the cache
    routing = await RedisStore.connect(REDIS_URL, namespace=f.store.keys.namespace, timeout_s=5.0)
    try:
        table = RoutingTable.build(Fleet.of([A, B]), RouterConfig())
        key = extract_key(PROMPT.encode(), settings=table.key_settings)
        routed = [await routing.route(key, table, "req-0")]
        # held in flight, they fill the holder to the in-flight bound, then go to the other
        while routed[-1].decision.outcome is not Outcome.SPILLED and len(routed) < 40:
            routed.append(await routing.route(key, table, f"req-{len(routed)}"))
        spilled = routed[-1]
        assert spilled.decision.outcome is Outcome.SPILLED
        counts = {i: [r.instance_id for r in routed].count(i) for i in (A.id, B.id)}
        for _ in range(500):  # the counts ride on the store's next round trip
            if await routing.in_flight() == counts:
                break
            await asyncio.sleep(0.01)
        await f.view.tick()
    finally:
        await routing.close()
    snap = f.view.snapshot()
    rows = {r.id: r for r in snap.instances}
    assert list(rows) == f.ids()

    a, b = rows[A.id], rows[B.id]
    assert a.up and b.up and a.error is None
    assert a.prefix_cache_queries is not None and a.prefix_cache_hits is not None
    assert a.prefix_cache_hits > 0
    assert a.hit_rate_cumulative == pytest.approx(a.prefix_cache_hits / a.prefix_cache_queries)
    # the window holds only the second request: it hit more than the two together
    assert a.hit_rate is not None and a.hit_rate > a.hit_rate_cumulative
    assert a.ttft_p50_s is not None and a.ttft_p99_s is not None and a.ttft_p50_s <= a.ttft_p99_s
    assert b.hit_rate is None and b.hit_rate_cumulative is None  # B served nothing
    assert (a.running, a.waiting, a.kv_cache_usage) == (0, 0, 0)

    assert not rows[f.down.id].up and "ConnectError" in (rows[f.down.id].error or "")
    assert not rows[f.not_vllm.id].up and "MetricsFormatError" in (rows[f.not_vllm.id].error or "")
    assert rows[f.down.id].running is None and rows[f.down.id].hit_rate_cumulative is None

    state = await f.store.read()
    expected_share = RoutingTable.build(state.fleet.fleet, state.config.config).ring.share()
    assert {r.id: r.ring_share for r in snap.instances} == expected_share
    assert sum(expected_share.values()) == pytest.approx(1.0)
    assert b.ring_share > a.ring_share  # weight 2

    assert (a.in_flight, b.in_flight) == (counts[A.id], counts[B.id])
    homes = len(routed) - 2
    assert snap.fleet.decisions == {"placed": 1, "spilled": 1} | ({"home": homes} if homes else {})
    assert snap.fleet.predicted_affinity == pytest.approx(homes / (homes + 1))
    assert [(s["home"], s["to"], s["request_id"]) for s in snap.spills] == [
        (routed[0].instance_id, spilled.instance_id, f"req-{len(routed) - 1}")
    ]
    routable = sum(1 for r in snap.instances if r.routable)
    bound = RouterConfig().spill.load_factor * len(routed) / routable + IN_FLIGHT_SLACK
    assert snap.concurrency_threshold == 1 and snap.spill_limit == math.ceil(bound)
    assert snap.fleet.hit_rate == pytest.approx(a.hit_rate)  # only A served in the window
    assert snap.loads_error is None and snap.state_error is None

    assert snap.supervision is None  # not run by prefix-router up: no process table
    assert (
        "component_restarts" not in render(ControlPlaneCollector(f.view, ClientRegistry())).decode()
    )

    # with every source present, every declared metric is exported
    sync = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        write_report(sync, f.store.keys.namespace, REPORT)
    finally:
        sync.close()
    await f.view.refresh()
    assert f.view.snapshot().supervision == REPORT
    clients = ClientRegistry()
    node = base_pb2.Node(id="envoy-0")
    clients.on_response(1, node, CLUSTER_TYPE, "1.1")
    clients.on_ack(1, node, CLUSTER_TYPE, "1.1")
    clients.on_nack(1, node, CLUSTER_TYPE, "1.1", "no")
    text = render(ControlPlaneCollector(f.view, clients, lambda: "1.1")).decode()
    families = {fam.name for fam in text_string_to_metric_families(text)}
    declared = {PREFIX + name.removesuffix("_total") for name in METRIC_NAMES}
    assert families == declared
    samples = {
        (sample.name, sample.labels.get("component")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("component")
    }
    assert samples == {
        (PREFIX + "component_restarts_total", "redis"): 0,
        (PREFIX + "component_restarts_total", "envoy"): 2,
        (PREFIX + "component_up", "redis"): 1,
        (PREFIX + "component_up", "envoy"): 0,
    }


async def test_admin_routes_fleet_metrics_and_page(fleetside: Fleetside) -> None:
    f = fleetside
    await f.view.tick()
    await complete(f.client, A, PROMPT)
    await f.view.tick()
    clients = ClientRegistry()
    node = base_pb2.Node(id="envoy-7", cluster="prefix-router")
    clients.on_stream_open(1, node)
    for type_url in (CLUSTER_TYPE, ENDPOINT_TYPE, CLUSTER_TYPE):
        clients.on_response(1, node, type_url, "1.1")
    clients.on_ack(1, node, CLUSTER_TYPE, "1.1")
    clients.on_nack(1, node, ENDPOINT_TYPE, "1.1", "bad endpoint")
    service = AdminService(
        f.store, f.store, clients=clients, view=f.view, published_version=lambda: "1.1"
    )
    app = create_app(service, token=TOKEN)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as admin:
        assert (await admin.get("/fleet")).status_code == 401
        assert (
            await admin.get("/fleet", headers={"Authorization": "Bearer no"})
        ).status_code == 401
        fleet = (await admin.get("/fleet", headers=AUTH)).json()
        assert [i["id"] for i in fleet["instances"]] == f.ids()
        assert fleet["concurrency_threshold"] == 1 and fleet["published_snapshot"] == "1.1"
        assert fleet["xds_clients"][0]["node_id"] == "envoy-7"

        # a config change shows in the very next /fleet, not at the next scrape round
        patched = await admin.patch("/config", json={"concurrency_threshold": 9}, headers=AUTH)
        assert patched.status_code == 200
        assert (await admin.get("/fleet", headers=AUTH)).json()["concurrency_threshold"] == 9

        metrics = await admin.get("/metrics")  # no token: Prometheus scrapes it as is
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        got = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(metrics.text)
            for s in fam.samples
        }

        page = await admin.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/ui/status.js">' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        script = await admin.get("/ui/status.js")
        assert script.status_code == 200 and "Authorization" in script.text

    def value(name: str, **labels: str) -> float:
        return got[(PREFIX + name, tuple(sorted(labels.items())))]

    assert value("xds_pushes_total", node="envoy-7", type="cds") == 2
    assert value("xds_pushes_total", node="envoy-7", type="eds") == 1
    assert value("xds_acks_total", node="envoy-7", type="cds") == 1
    assert value("xds_nacks_total", node="envoy-7", type="eds") == 1
    assert value("xds_streams", node="envoy-7") == 1
    assert value("config_version") == 2 and value("fleet_version") == 1
    assert value("published_fleet_version") == 1 and value("published_config_version") == 1
    assert value("concurrency_threshold") == 9
    assert value("instances", state="active", health="healthy") == 4
    assert value("instances", state="draining", health="healthy") == 0
    assert value("redis_up") == 1 and value("state_up") == 1
    assert value("instance_scrape_up", instance_id=A.id) == 1
    assert value("instance_scrape_up", instance_id=f.down.id) == 0
    assert value("prefix_cache_queries_total", instance_id=A.id) > 0
    assert value("requests_running", instance_id=A.id) == 0
    assert (
        PREFIX + "requests_running",
        (("instance_id", f.down.id),),
    ) not in got  # unknown: absent
    assert value("time_to_first_token_seconds", instance_id=A.id, quantile="0.5") > 0
    assert sum(value("ring_share_ratio", instance_id=i.id) for i in (A, B, f.down, f.not_vllm)) == (
        pytest.approx(1.0)
    )
    assert value("decisions_total", outcome="home") == 0


async def test_redis_down_is_reported_not_raised() -> None:
    store = StateStore.from_url("redis://127.0.0.1:1/0", "nowhere:")
    view = FleetView(store, redis_timeout_s=0.2)
    try:
        await view.tick()
        snap = view.snapshot()
        assert snap.state_error and snap.loads_error and snap.instances == ()
        text = render(ControlPlaneCollector(view, ClientRegistry())).decode()
        assert f"{PREFIX}redis_up 0.0" in text and f"{PREFIX}state_up 0.0" in text
    finally:
        await view.close()
        await store.close()


async def test_each_scrape_publishes_the_waiting_count_an_instance_reports() -> None:
    """The control plane passes each instance's ``vllm:num_requests_waiting`` to every
    ext_proc replica through Redis, stamped with when it was read, and stops stamping it
    when the instance's metrics cannot be read (the routers then drop it)."""
    waiting = {"n": 7, "up": True}

    def metrics(request: httpx.Request) -> httpx.Response:
        if not waiting["up"]:
            raise httpx.ConnectError("refused", request=request)
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting["n"]}.0\n'
        )
        return httpx.Response(200, text=text)

    async with (
        fresh_store() as store,
        httpx.AsyncClient(transport=httpx.MockTransport(metrics)) as client,
    ):
        await store.seed(Fleet.of([A]), RouterConfig())
        view = FleetView(store, client=client, redis_timeout_s=5.0, wall_clock=lambda: 1000.0)
        models_key = f"{store.keys.namespace}models"

        async def published() -> InstanceModel:
            raw = await store.redis.hget(models_key, A.id)
            assert raw is not None
            return model_of_text(raw, 1001.0)

        await view.tick()
        assert await published() == InstanceModel(0.0, 0.0, 7)
        waiting["n"] = 0
        await view.tick()
        assert await published() == InstanceModel(0.0, 0.0, 0)
        waiting.update(n=30, up=False)
        await view.tick()
        assert (await published()).waiting == 0
        assert (await store.redis.hget(models_key, A.id)).split()[2:] == []


async def test_instances_serving_one_model_share_a_rate_and_another_models_get_their_own() -> None:
    """The prefill rate published for each instance is the median of the instances that
    serve the same models: a fleet of a 70B and an 8B pool gets one rate for each, not
    one median that is wrong for both (here: 15,336 for all three)."""
    big = [
        Instance("127.0.0.1", 9101, models=("big",)),
        Instance("127.0.0.1", 9102, models=("big",)),
    ]
    small = Instance("127.0.0.1", 9103, models=("small",))
    tokens_per_tick = {9101: 20_000, 9102: 28_000, 9103: 60_000}  # 2 s of prefill a tick
    ticks = {"n": 0}

    def metrics(request: httpx.Request) -> httpx.Response:
        n, queried = ticks["n"], tokens_per_tick[request.url.port]
        text = (
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {n * queried}.0\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            'vllm:prefix_cache_hits_total{model_name="m"} 0.0\n'
            "# TYPE vllm:request_prefill_time_seconds histogram\n"
            f'vllm:request_prefill_time_seconds_sum{{model_name="m"}} {n * 2.0}\n'
        )
        return httpx.Response(200, text=text)

    now = {"t": 0.0}
    async with (
        fresh_store() as store,
        httpx.AsyncClient(transport=httpx.MockTransport(metrics)) as client,
    ):
        await store.seed(Fleet.of([*big, small]), RouterConfig())
        view = FleetView(store, client=client, redis_timeout_s=5.0, clock=lambda: now["t"])
        for _ in range(3):  # 20 s: 4 s of prefill in the window
            ticks["n"] += 1
            now["t"] += 10.0
            await view.tick()
        raw = await store.redis.hgetall(f"{store.keys.namespace}models")
        rate = {k.decode(): model_of_text(v, 0.0).prefill_tokens_per_s for k, v in raw.items()}
    per_second_of_window = math.sqrt(1 + 2.0 / 10.0)  # core.work.learned_prefill_rate
    assert rate[big[0].id] == rate[big[1].id] == pytest.approx(12_000 * per_second_of_window, abs=1)
    assert rate[small.id] == pytest.approx(30_000 * per_second_of_window, abs=1)


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("3.7", (3.0, 7.0)),
        ("3.7.e786f7ff", (3.0, 7.0)),  # instances named by DNS: a digest of their addresses
        ("", None),
        (None, None),
        ("3", None),
        ("3.x", None),
        ("3.7.e786f7ff.0c1d2e3f", (3.0, 7.0)),  # and told apart by content (Publisher)
    ],
)
def test_the_published_versions_are_read_from_every_form_of_version_info(
    version: str | None, expected: tuple[float, float] | None
) -> None:
    """The alert on a config not yet published compares against these gauges: a fleet
    named by DNS must export them too."""
    assert split_version(version) == expected


async def test_an_instance_not_scraped_yet_has_no_scrape_up_series(fleetside: Fleetside) -> None:
    """With the fleet view off (--fleet-scrape-interval 0) nothing is ever scraped, and
    before its first round nothing is yet: instance_scrape_up is absent then, not 0 (the
    documented alert on it would fire for every instance)."""
    collector = ControlPlaneCollector(fleetside.view, ClientRegistry(), lambda: None)

    def up() -> dict[str, float]:
        return {
            s.labels["instance_id"]: s.value
            for m in collector.collect()
            if m.name == PREFIX + "instance_scrape_up"
            for s in m.samples
        }

    await fleetside.view.refresh()
    assert up() == {}
    await fleetside.view.tick()
    assert up()[A.id] == 1.0 and up()[fleetside.down.id] == 0.0


async def test_the_metrics_forget_xds_clients_gone_a_while(fleetside: Fleetside) -> None:
    """A gone client's per-node series end with it, also when no stream closes and no one
    reads /status after it went (the collector itself forgets)."""
    now = [1000.0]
    clients = ClientRegistry(clock=lambda: now[0])
    node = base_pb2.Node(id="envoy-gone")
    clients.on_stream_open(1, node)
    clients.on_stream_closed(1, node)
    collector = ControlPlaneCollector(fleetside.view, clients, lambda: None)

    def nodes() -> set[str]:
        return {
            s.labels["node"]
            for m in collector.collect()
            if m.name == PREFIX + "xds_streams"
            for s in m.samples
        }

    assert nodes() == {"envoy-gone"}
    now[0] += 3600
    assert nodes() == set()
