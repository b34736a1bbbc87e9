"""Pools by model, without I/O: which instances a request may reach, and the router's
decisions within a pool (in-process store), and the Envoy clusters rendered for them."""

from __future__ import annotations

import json

import orjson
import pytest

from control_plane.snapshot import CLUSTER_TYPE, build_snapshot
from ext_proc.router import RequestRouter
from prefix_router.core.config import PrefixMode, RouterConfig
from prefix_router.core.decision import Outcome
from prefix_router.core.errors import FleetError
from prefix_router.core.fleet import Fleet, Instance, InstanceState, ServedModel
from prefix_router.core.key import KeySettings, extract_key
from prefix_router.core.pools import (
    layout,
    models_list_body,
    request_model,
    unknown_model_body,
)
from prefix_router.core.ring import ring_size_for
from prefix_router.core.table import RoutingTable
from prefix_router.envoy.cluster import load_assignments, model_clusters
from prefix_router.state.routing import InProcessStore

CONFIG = RouterConfig()
PATH = "/v1/chat/completions"


def inst(port: int, *models: str, **changes: object) -> Instance:
    return Instance("10.0.0.1", port, models=models).with_changes(**changes)


# Two base models on disjoint instances, an adapter of base-a on two of base-a's three.
TWO_MODELS = Fleet.of(
    [
        inst(8001, "base-a"),
        inst(8002, "base-a", "a-sql"),
        inst(8003, "base-a", "a-sql"),
        inst(8004, "base-b"),
        inst(8005, "base-b"),
    ]
)


def body(model: str | None, text: str) -> bytes:
    request: dict[str, object] = {"messages": [{"role": "user", "content": text}]}
    if model is not None:
        request["model"] = model
    return json.dumps(request).encode()


def members(table: RoutingTable, model: str | None) -> set[int]:
    pool = table.pool_for(model)
    assert pool is not None
    return {int(table.ids[i].rsplit(":", 1)[1]) for i in pool.members}


@pytest.mark.parametrize(
    ("model", "ports"),
    [
        ("base-a", {8001, 8002, 8003}),
        ("a-sql", {8002, 8003}),
        ("base-b", {8004, 8005}),
        (None, {8001, 8002, 8003, 8004, 8005}),  # names no model: the whole fleet
    ],
)
def test_the_model_picks_the_instances_that_serve_it(model: str | None, ports: set[int]) -> None:
    assert members(RoutingTable.build(TWO_MODELS, CONFIG), model) == ports


def test_a_model_no_instance_serves_is_unknown_when_every_instance_declares() -> None:
    table = RoutingTable.build(TWO_MODELS, CONFIG)
    assert table.pooled and table.catch_all is None
    assert table.pool_for("base-c") is None


def test_an_instance_that_declares_nothing_may_serve_anything() -> None:
    fleet = Fleet.of([inst(8001, "base-a"), inst(8002), inst(8003, "base-b")])
    table = RoutingTable.build(fleet, CONFIG)
    assert members(table, "base-a") == {8001, 8002}
    assert members(table, "base-b") == {8002, 8003}
    assert members(table, "base-c") == {8002}  # the catch-all
    lay = layout(fleet.instances)
    assert set(lay.clusters()) == {"models/base-a", "models/base-b", "models/*"}


def test_a_fleet_that_declares_nothing_routes_exactly_as_without_pools() -> None:
    fleet = Fleet.of([inst(8000 + i) for i in range(4)])
    table = RoutingTable.build(fleet, CONFIG)
    assert not table.pooled and not layout(fleet.instances).clusters()
    for model in ("anything", None):
        assert table.pool_for(model) is table.whole
    plain = KeySettings(prefix_length=CONFIG.prefix_length, mode=PrefixMode.OPENAI, block_bytes=512)
    assert table.key_settings == plain  # so keys are what they were
    assert extract_key(body("m", "hi"), settings=table.key_settings).model == "m"
    assert table.models_body == b""


def test_discovered_models_count_until_some_are_declared() -> None:
    found = (ServedModel("base-a"), ServedModel("a-sql", parent="base-a"))
    discovered = inst(8001, discovered=found)
    assert discovered.serves == ("base-a", "a-sql")
    assert discovered.with_changes(models=("base-b",)).serves == ("base-b",)
    table = RoutingTable.build(Fleet.of([discovered, inst(8002, "base-b")]), CONFIG)
    assert members(table, "a-sql") == {8001}
    assert table.pool_for("base-c") is None


def test_draining_and_unhealthy_instances_leave_the_pools_ring_not_the_pool() -> None:
    fleet = Fleet.of(
        [
            inst(8001, "base-a", state=InstanceState.DRAINING),
            inst(8002, "base-a", healthy=False),
            inst(8003, "base-a"),
            inst(8004, "base-b", state=InstanceState.DRAINING),
        ]
    )
    table = RoutingTable.build(fleet, CONFIG)
    assert members(table, "base-a") == {8003}
    assert members(table, "base-b") == set()  # known, but nothing routable: not a 404
    clusters = {c["name"]: c for c in model_clusters(CONFIG, fleet, eds=True)}
    size = clusters["models/base-a"]["ring_hash_lb_config"]["minimum_ring_size"]
    assert int(size) == ring_size_for([fleet.instances[2]], CONFIG.ring.entries_per_weight)


def test_each_pools_cluster_holds_its_instances_with_its_own_ring_size() -> None:
    fleet = Fleet.of([*TWO_MODELS.instances[:3], TWO_MODELS.instances[3].with_changes(weight=3)])
    clusters = {c["name"]: c for c in model_clusters(CONFIG, fleet, eds=True)}
    assert list(clusters) == ["models", "models/a-sql", "models/base-a", "models/base-b"]
    table = RoutingTable.build(fleet, CONFIG)
    for model, pool in table.pools.items():
        cluster = clusters[f"models/{model}"]
        assert cluster["eds_cluster_config"]["service_name"] == f"models/{model}"
        assert int(cluster["ring_hash_lb_config"]["minimum_ring_size"]) == len(pool.ring)
    ports = {
        a["cluster_name"]: [
            e["endpoint"]["address"]["socket_address"]["port_value"]
            for e in a["endpoints"][0]["lb_endpoints"]
        ]
        for a in load_assignments(fleet)
    }
    assert ports["models/a-sql"] == [8002, 8003]
    assert ports["models/base-b"] == [8004]
    snapshot = build_snapshot(fleet, CONFIG, config_version=1)
    snapshot.consistent()
    assert len(snapshot.names(CLUSTER_TYPE)) == 4


async def test_every_decision_stays_inside_the_pool_spill_included() -> None:
    """A hot prefix of a-sql, held in flight, spills over a-sql's two instances only."""
    table = RoutingTable.build(TWO_MODELS, RouterConfig.model_validate({"placement": {"width": 1}}))
    router = RequestRouter(table, InProcessStore())
    pools = {m: members(table, m) for m in ("base-a", "a-sql", "base-b")}
    held = []
    for n in range(60):  # 20 a model: past the in-flight bound of a pool of two
        model = ("a-sql", "base-b", "base-a")[n % 3]
        result = await router.route(body(model, "the same hot prompt " * 40), path=PATH, tenant="")
        held.append(result)
        decision = result.decision
        assert decision.instance_id is not None
        assert int(decision.instance_id.rsplit(":", 1)[1]) in pools[model]
        assert decision.pool_header == f"models/{model}"
        pool = table.pool_for(model)
        assert pool is not None and decision.header_value is not None
        picked = pool.ring.pick(decision.header_value)  # what Envoy's pool cluster picks
        assert picked is not None and picked.id == decision.instance_id
    spilled = [r for r in held if r.decision.outcome is Outcome.SPILLED]
    assert spilled, "a hot prefix held in flight must spill"
    sql = {r.decision.instance_id for r in held if r.decision.pool == "a-sql"}
    assert len(sql) == 2  # spread over its whole pool, and nowhere else
    for r in held:
        router.finish(r)


async def test_an_unknown_model_is_answered_as_vllm_answers_it() -> None:
    router = RequestRouter(RoutingTable.build(TWO_MODELS, CONFIG), InProcessStore())
    result = await router.route(body("base-c", "hi"), path=PATH, tenant="")
    assert result.decision.outcome is Outcome.UNKNOWN_MODEL
    assert result.reserved is None and result.answer is not None
    assert orjson.loads(result.answer) == {
        "error": {
            "message": "The model `base-c` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert await router.store.in_flight() == {}


@pytest.mark.parametrize("model", ["", "  "])
async def test_an_empty_model_name_goes_over_the_whole_fleet(model: str) -> None:
    """vLLM serves its default model for an empty name: the router must not answer 404."""
    router = RequestRouter(RoutingTable.build(TWO_MODELS, CONFIG), InProcessStore())
    result = await router.route(body(model, "hi"), path=PATH, tenant="")
    assert result.answer is None and result.decision.outcome is not Outcome.UNKNOWN_MODEL
    assert result.decision.pool_header is None
    router.finish(result)


def test_a_new_instance_of_a_pool_takes_only_keys_of_that_pool() -> None:
    grown = Fleet.of([*TWO_MODELS.instances, inst(8006, "base-b")])
    before, after = RoutingTable.build(TWO_MODELS, CONFIG), RoutingTable.build(grown, CONFIG)
    for model in ("base-a", "a-sql", "base-b"):
        old, new = before.pool_for(model), after.pool_for(model)
        assert old is not None and new is not None
        for n in range(300):
            key = f"key-{n}"
            was, now = old.ring.pick(key), new.ring.pick(key)
            assert was is not None and now is not None
            if model != "base-b":
                assert now.id == was.id
            else:
                assert now.id == was.id or now.port == 8006


def test_the_key_is_scoped_by_model_in_a_pooled_fleet_in_every_mode() -> None:
    table = RoutingTable.build(TWO_MODELS, CONFIG)
    raw = RoutingTable.build(TWO_MODELS, RouterConfig.model_validate({"prefix_mode": "bytes"}))
    for settings in (table.key_settings, raw.key_settings):
        # the model comes last in the body: only the seed tells the two apart in bytes mode
        a = b'{"messages": [{"role": "user", "content": "hi"}], "model": "base-a"}'
        b = a.replace(b"base-a", b"base-b")
        ka, kb = (extract_key(x, settings=settings) for x in (a, b))
        assert (ka.model, kb.model) == ("base-a", "base-b")
        assert ka.blocks[0] != kb.blocks[0]


@pytest.mark.parametrize(
    ("raw", "model"),
    [
        (b'{"model": "e5", "input": "embed me"}', "e5"),
        (b'  {"input": "x"}', None),
        (b'{"model": 3}', None),
        (b"[1, 2]", None),
        (b"not json", None),
        (b"", None),
    ],
)
def test_the_request_model_is_read_from_any_json_body(raw: bytes, model: str | None) -> None:
    assert request_model(raw, max_parse_bytes=64) == model


IMAGE = b'"' + b"A" * 200_000 + b'"'  # a large base64 image: past the parse limit


@pytest.mark.parametrize(
    ("raw", "model"),
    [
        (b'{"model": "base-b", "messages": [{"content": ' + IMAGE + b"}]}", "base-b"),
        # the OpenAI Python client writes the messages first: found in the body's tail
        (b'{"messages": [{"content": ' + IMAGE + b'}], "model" :"base-\\u0062"}', "base-b"),
        # a quoted "model" inside a string is escaped, so it is never taken for the field
        (b'{"messages": [{"content": "say \\"model\\": \\"x\\" ' + b"A" * 200_000 + b'"}]}', None),
        (b'{"messages": [{"content": ' + IMAGE + b"}]}", None),
    ],
)
def test_a_body_too_large_to_parse_still_names_its_model(raw: bytes, model: str | None) -> None:
    assert request_model(raw, max_parse_bytes=64 * 1024) == model


def test_a_body_envoy_cut_short_names_its_model_from_its_start() -> None:
    table = RoutingTable.build(TWO_MODELS, CONFIG)
    start = b'{"model": "base-b", "messages": [{"role": "user", "content": "' + b"x" * 1000
    key = extract_key(start, settings=table.key_settings, path=PATH, complete=False)
    assert key.model == "base-b"


def test_an_embeddings_request_finds_its_pool_by_its_model() -> None:
    table = RoutingTable.build(TWO_MODELS, CONFIG)
    key = extract_key(
        b'{"model": "base-b", "input": "embed me"}',
        settings=table.key_settings,
        path="/v1/embeddings",
    )
    assert key.model == "base-b" and members(table, key.model) == {8004, 8005}


def test_the_models_list_is_the_union_with_adapter_parents() -> None:
    fleet = [
        inst(8001, discovered=(ServedModel("base-a"), ServedModel("a-sql", parent="base-a"))),
        inst(8002, "base-b"),
        inst(8003, "base-a"),
    ]
    listed = orjson.loads(models_list_body(fleet))
    assert listed["object"] == "list"
    assert [(m["id"], m["parent"], m["object"]) for m in listed["data"]] == [
        ("a-sql", "base-a", "model"),
        ("base-a", None, "model"),
        ("base-b", None, "model"),
    ]
    assert "`x`" in orjson.loads(unknown_model_body("x"))["error"]["message"]


def test_model_names_must_fit_a_cluster_name_and_a_header() -> None:
    for bad in ("", "has space", "tab\there", "é", "x" * 257):
        with pytest.raises(FleetError, match="model name"):
            inst(8001, bad)
    assert Instance.from_url("10.0.0.1:8001:2#base-a, a-sql").models == ("base-a", "a-sql")
    back = Instance.from_url(inst(8001, "base-a", "a-sql").to_url())
    assert back == inst(8001, "base-a", "a-sql")


def test_pools_of_the_same_instances_share_one_ring_and_keep_their_names() -> None:
    fleet = Fleet.of([inst(8001, "base-a", "a-sql", "a-chat"), inst(8002, "base-a", "a-sql")])
    table = RoutingTable.build(fleet, CONFIG)
    base, sql, chat = (table.pools[m] for m in ("base-a", "a-sql", "a-chat"))
    assert sql.ring is base.ring and chat.ring is not base.ring
    assert (base.header, sql.header) == ("models/base-a", "models/a-sql")
    assert sql.name == "a-sql"
