"""``prefix-router envoy-bootstrap``: the bootstrap containers render before Envoy starts."""

from __future__ import annotations

import asyncio
import resource
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from prefix_router.core.config import RouterConfig
from prefix_router.core.errors import ConfigError
from prefix_router.envoy.bootstrap import (
    BootstrapParams,
    default_max_downstream_connections,
    render_bootstrap,
)
from prefix_router.ops.bootstrap_cli import build, main, parse_host_port
from prefix_router.ops.cli import main as cli_main
from prefix_router.ops.launch import start_envoy, start_ext_proc, start_module
from prefix_router.ops.procs import envoy_binary, free_port
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.envoy_probe import start_envoy_with_probe_listener
from tests.support.redis_ns import fresh_store, unique_namespace
from tests.support.wait import wait_until
from tests.support.xds_stack import start_backends

CONTAINER_ARGS = [
    "--listen-address",
    "0.0.0.0",
    "--probe-address",
    "0.0.0.0",
    "--probe-port",
    "9902",
    "--ext-proc",
    "ext-proc:50051",
    "--xds",
    "control-plane:18000",
    "--node-id",
    "envoy-a",
]


def _render(tmp_path: Path, args: list[str]) -> dict[str, Any]:
    out = tmp_path / "envoy.yaml"
    assert main([*args, "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert isinstance(doc, dict)
    return doc


def _clusters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


def _hosts(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]


def test_hostnames_make_strict_dns_clusters(tmp_path: Path) -> None:
    doc = _render(tmp_path, CONTAINER_ARGS)
    clusters = _clusters(doc)
    assert set(clusters) == {"ext_proc", "xds", "envoy_admin"}  # models come over CDS
    for name, host in (("ext_proc", ("ext-proc", 50051)), ("xds", ("control-plane", 18000))):
        assert clusters[name]["type"] == "STRICT_DNS"
        assert clusters[name]["dns_lookup_family"] == "V4_PREFERRED"
        assert _hosts(clusters[name]) == [host]
    assert doc["node"]["id"] == "envoy-a"
    assert doc["dynamic_resources"]["cds_config"] == {"ads": {}, "resource_api_version": "V3"}
    listener = doc["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": 8080}
    assert doc["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}


def test_ip_literals_keep_static_clusters(tmp_path: Path) -> None:
    doc = _render(
        tmp_path,
        ["--ext-proc", "127.0.0.1:50051", "--ext-proc", "[::1]:50052", "--xds", "10.1.2.3:18000"],
    )
    clusters = _clusters(doc)
    assert clusters["ext_proc"]["type"] == "STATIC"
    assert "dns_lookup_family" not in clusters["ext_proc"]
    assert _hosts(clusters["ext_proc"]) == [("127.0.0.1", 50051), ("::1", 50052)]
    assert clusters["xds"]["type"] == "STATIC"


def test_one_name_among_ips_makes_the_cluster_strict_dns(tmp_path: Path) -> None:
    doc = _render(
        tmp_path, ["--ext-proc", "127.0.0.1:1", "--ext-proc", "ext-proc:2", "--xds", "127.0.0.1:3"]
    )
    assert _clusters(doc)["ext_proc"]["type"] == "STRICT_DNS"


def test_static_fleet_from_a_fleet_file(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"instances": [{"address": "10.0.0.7", "port": 8000}]}))
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump({"routing": {"retry": {"enabled": False}}}))
    doc = _render(
        tmp_path, ["--ext-proc", "127.0.0.1:1", "--fleet", str(fleet), "--config", str(config)]
    )
    clusters = _clusters(doc)
    assert "dynamic_resources" not in doc
    assert clusters["models"]["lb_policy"] == "RING_HASH"
    assert _hosts(clusters["models"]) == [("10.0.0.7", 8000)]


def test_env_fallbacks_and_flags_win() -> None:
    env = {
        "PREFIX_ROUTER_BOOTSTRAP_EXT_PROC": "a:1,b:2",
        "PREFIX_ROUTER_BOOTSTRAP_XDS": "cp:18000",
        "PREFIX_ROUTER_BOOTSTRAP_LISTEN_PORT": "10000",
        "PREFIX_ROUTER_BOOTSTRAP_NODE_ID": "from-env",
    }
    params, _, fleet, out = build([], env)
    assert params.ext_proc == (("a", 1), ("b", 2))
    assert params.xds == ("cp", 18000)
    assert (params.listen_port, params.node_id, fleet, out) == (10000, "from-env", None, None)
    params, *_ = build(["--ext-proc", "c:3", "--node-id", "flag"], env)
    assert params.ext_proc == (("c", 3),) and params.node_id == "flag"


def test_the_cli_renders_what_prefix_router_up_renders_by_default() -> None:
    """Compose and Kubernetes render with the CLI, ``up`` with ``BootstrapParams``: the
    same body limits (a 4 MiB buffer once answered 413 to every larger body) and the same
    ext_proc timeout."""
    params, *_ = build(["--ext-proc", "a:1", "--xds", "b:2"], {})
    default = BootstrapParams(listen_port=params.listen_port, admin_port=params.admin_port,
                              ext_proc=params.ext_proc)  # fmt: skip
    assert (params.body_buffer_bytes, params.max_body_bytes, params.ext_proc_timeout_ms) == (
        default.body_buffer_bytes,
        default.max_body_bytes,
        default.ext_proc_timeout_ms,
    )
    params, *_ = build(["--ext-proc", "a:1", "--xds", "b:2", "--max-body-bytes", "1048576"], {})
    assert params.body_buffer_bytes == 1048576 + 64 * 1024


def test_envoy_pings_the_control_plane_to_notice_one_gone_with_its_node() -> None:
    params, config, fleet, _ = build(["--ext-proc", "a:1", "--xds", "10.1.2.3:18000"], {})
    xds = _clusters(yaml.safe_load(render_bootstrap(params, config, fleet)))["xds"]
    [options] = xds["typed_extension_protocol_options"].values()
    keepalive = options["explicit_http_config"]["http2_protocol_options"]["connection_keepalive"]
    assert keepalive == {"interval": "15s", "timeout": "5s"}


def test_the_client_connection_cap_follows_the_hard_open_file_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Envoy raises its soft limit to the hard one: a container started at 1,024 soft
    under 524,288 hard (containerd 2, Docker 29) serves 262,144 clients, not 1,024."""
    limits = {"containerd": (1024, 524_288), "small": (1024, 1024), "none": (1024, -1)}
    expected = {"containerd": 262_144, "small": 1024, "none": 1_000_000}
    for name, (soft, hard) in limits.items():
        hard_limit = resource.RLIM_INFINITY if hard < 0 else hard
        monkeypatch.setattr(resource, "getrlimit", lambda _, s=soft, h=hard_limit: (s, h))
        assert default_max_downstream_connections() == expected[name], name


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no ext_proc
        ["--ext-proc", "a:1"],  # neither --xds nor --fleet
        ["--ext-proc", "a:1", "--xds", "b:2", "--fleet", "f.yaml"],
        ["--ext-proc", "a", "--xds", "b:2"],
        ["--ext-proc", "a:0", "--xds", "b:2"],
        ["--ext-proc", "a:1", "--xds", "b:2", "--listen-port", "x"],
        ["--ext-proc", "a:1", "--xds", "b:2", "--listen-port", "9901"],
        ["--ext-proc", "a:1", "--xds", "b:2", "--probe-port", "9901"],
        ["--ext-proc", "a:1", "--xds", "b:2", "--probe-port", "8080"],
        # a buffer below the largest body: Envoy would answer 413 to bodies it should route
        ["--ext-proc", "a:1", "--xds", "b:2", "--body-buffer-bytes", "4194304"],
    ],
)
def test_bad_flags_are_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        build(argv, {})


def test_parse_host_port() -> None:
    assert parse_host_port("ext-proc:50051") == ("ext-proc", 50051)
    assert parse_host_port("[fd00::1]:80") == ("fd00::1", 80)
    for bad in ("::1:80", "[::1]", "host:", ":80", "h:65536"):
        with pytest.raises(ConfigError):
            parse_host_port(bad)


def test_cli_prints_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["envoy-bootstrap", *CONTAINER_ARGS]) == 0
    assert _clusters(yaml.safe_load(capsys.readouterr().out))["xds"]["type"] == "STRICT_DNS"
    assert cli_main(["envoy-bootstrap", "--ext-proc", "a:1"]) == 2  # ConfigError -> exit 2


def test_envoy_keeps_its_ext_proc_client_far_longer_than_any_request(tmp_path: Path) -> None:
    """Issue 19: Envoy 1.40 crashes when an ext_proc stream outlives the worker's cached gRPC
    client (Envoy's default idle time 50 s); the bootstrap keeps it at least a day, with
    graceful close on (tests/test_long_responses.py shows both through Envoy)."""
    doc = _render(tmp_path, CONTAINER_ARGS)
    idle = doc["grpc_async_client_manager_config"]["max_cached_entry_idle_duration"]
    assert idle.endswith("s") and int(idle[:-1]) >= 24 * 3600
    runtime = doc["layered_runtime"]["layers"][0]["static_layer"]
    assert runtime["envoy.reloadable_features.ext_proc_graceful_grpc_close"] is True


def test_a_client_idle_time_below_envoys_minimum_is_a_config_error() -> None:
    params = BootstrapParams(
        listen_port=1, admin_port=2, ext_proc=(("127.0.0.1", 3),), xds=("127.0.0.1", 4),
        grpc_client_idle_s=4,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="at least 5"):
        render_bootstrap(params, RouterConfig())
    assert "max_cached_entry_idle_duration: 5s" in render_bootstrap(
        replace(params, grpc_client_idle_s=5), RouterConfig()
    )


def test_envoy_accepts_the_container_bootstrap(tmp_path: Path) -> None:
    """The real Envoy validates the rendered bootstrap (no DNS lookups in validate mode),
    with the Kubernetes manifest's heap limit: 503s at 95% of it, not an OOM kill."""
    out = tmp_path / "envoy.yaml"
    assert main([*CONTAINER_ARGS, "--max-heap-bytes", str(900 * 2**20), "--out", str(out)]) == 0
    manager = yaml.safe_load(out.read_text())["overload_manager"]
    heap = "envoy.resource_monitors.fixed_heap"
    monitor = manager["resource_monitors"][-1]
    assert (monitor["name"], monitor["typed_config"]["max_heap_size_bytes"]) == (heap, 900 * 2**20)
    assert manager["refresh_interval"] == "0.25s"
    assert {a["name"]: a["triggers"] for a in manager["actions"]} == {
        "envoy.overload_actions.shrink_heap": [{"name": heap, "threshold": {"value": 0.9}}],
        "envoy.overload_actions.stop_accepting_requests": [
            {"name": heap, "threshold": {"value": 0.95}}
        ],
    }
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.e2e
def test_names_resolve_through_real_envoy(procs: ProcessReaper, log_dir: Path) -> None:
    """ext_proc and the control plane given by name (STRICT_DNS), as in a container."""
    namespace = unique_namespace()
    backend = free_port()
    start_backends(procs, log_dir, [backend], "backend")
    fleet = log_dir / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"instances": [{"address": "127.0.0.1", "port": backend}]}))
    xds, admin = free_port(), free_port()
    try:
        procs.add(
            start_module(
                "control-plane",
                "prefix_router",
                [
                    "control-plane",
                    "--xds-port",
                    str(xds),
                    "--admin-port",
                    str(admin),
                    "--redis-url",
                    REDIS_URL,
                    "--namespace",
                    namespace,
                    "--fleet",
                    str(fleet),
                ],
                log_dir,
                ready_ports=[xds, admin],
                env={"PREFIX_ROUTER_ADMIN_TOKEN": "t"},
            )
        )
        ext_procs = [free_port(), free_port()]
        for port in ext_procs:
            procs.add(
                start_ext_proc(
                    port, log_dir, args=["--redis-url", REDIS_URL, "--namespace", namespace]
                )
            )
        listen, envoy_admin = free_port(), free_port()
        params, config, _, _ = build(
            [
                "--listen-port",
                str(listen),
                "--admin-port",
                str(envoy_admin),
                "--xds",
                f"localhost:{xds}",
                *(f"--ext-proc=localhost:{p}" for p in ext_procs),
            ],
            {},
        )
        procs.add(start_envoy(params, config, log_dir))
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "hello by name"}]}

        def routed() -> bool:
            r = httpx.post(url, json=body, timeout=5)
            return r.status_code == 200 and bool(r.json()["prefix_key"])

        wait_until(routed, 30, "a request through Envoy got a prefix key from ext_proc")
        keys = set()
        for _ in range(20):
            r = httpx.post(url, json=body, timeout=5)
            assert r.status_code == 200
            keys.add(r.json()["prefix_key"])
        assert len(keys) == 1 and keys != {None}
        clusters = httpx.get(f"http://127.0.0.1:{envoy_admin}/clusters?format=json").json()
        resolved = {
            c["name"]: sorted(
                h["address"]["socket_address"]["port_value"] for h in c.get("host_statuses", [])
            )
            for c in clusters["cluster_statuses"]
        }
        assert resolved["ext_proc"] == sorted(ext_procs)
        assert resolved["xds"] == [xds]
    finally:
        procs.stop_all()
        procs.started.clear()

        async def clean() -> None:
            async with fresh_store(namespace):
                pass

        asyncio.run(clean())


# -- the probe listener: Envoy's admin stays on loopback ------------------------------------


def test_probe_listener_routes_only_ready_and_stats_to_the_admin(tmp_path: Path) -> None:
    doc = _render(tmp_path, [*CONTAINER_ARGS, "--admin-port", "9911"])
    listeners = {entry["name"]: entry for entry in doc["static_resources"]["listeners"]}
    assert set(listeners) == {"data_plane", "probes"}
    assert listeners["data_plane"]["traffic_direction"] == "INBOUND"  # preStop's inboundonly
    probes = listeners["probes"]
    assert probes["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9902}
    assert "traffic_direction" not in probes  # not INBOUND: not drained with the data plane
    assert probes["ignore_global_conn_limit"] is True
    limit, hcm = probes["filter_chains"][0]["filters"]
    assert limit["typed_config"]["max_connections"] > 0
    (vhost,) = hcm["typed_config"]["route_config"]["virtual_hosts"]
    *proxied, rest = vhost["routes"]
    get_only = [{"name": ":method", "string_match": {"exact": "GET"}}]
    assert [
        (r["match"]["path"], r["match"]["headers"], r["route"]["cluster"]) for r in proxied
    ] == [(path, get_only, "envoy_admin") for path in ("/ready", "/stats/prometheus")]
    assert rest["match"] == {"prefix": "/"} and rest["direct_response"]["status"] == 404
    assert _hosts(_clusters(doc)["envoy_admin"]) == [("127.0.0.1", 9911)]
    assert doc["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_no_probe_listener_unless_asked(tmp_path: Path) -> None:
    """``prefix-router up`` renders without one (it reads the admin on 127.0.0.1 itself)."""
    doc = _render(tmp_path, ["--ext-proc", "127.0.0.1:1", "--xds", "127.0.0.1:2"])
    assert [entry["name"] for entry in doc["static_resources"]["listeners"]] == ["data_plane"]
    assert "envoy_admin" not in _clusters(doc)


def _status(url: str, method: str = "GET") -> int:
    return httpx.request(method, url, timeout=5).status_code


@pytest.mark.e2e
def test_real_envoy_probe_listener_serves_probes_and_nothing_that_changes_envoy(
    procs: ProcessReaper, log_dir: Path
) -> None:
    started = start_envoy_with_probe_listener(procs, log_dir)
    envoy, listen, admin, probe = started.process, started.listen, started.admin, started.probe
    probes = f"http://127.0.0.1:{probe}"
    assert httpx.get(f"{probes}/ready", timeout=5).text.strip() == "LIVE"
    stats = httpx.get(f"{probes}/stats/prometheus", timeout=5)
    assert stats.status_code == 200 and "envoy_server_live" in stats.text

    # What the admin interface would do if reachable: none of it gets through.
    for method, path in [
        ("POST", "/quitquitquit"),
        ("POST", "/runtime_modify?envoy.reloadable_features.x=false"),
        ("POST", "/healthcheck/fail"),
        ("POST", "/drain_listeners"),
        ("POST", "/logging?level=trace"),
        ("GET", "/config_dump"),
        ("GET", "/stats"),
        ("POST", "/ready"),
        ("GET", "/ready/../quitquitquit"),
    ]:
        assert _status(f"{probes}{path}", method) == 404, f"{method} {path}"
    assert envoy.alive()
    assert _status(f"{probes}/ready") == 200
    runtime = httpx.get(f"http://127.0.0.1:{admin}/runtime", timeout=5).json()
    assert "envoy.reloadable_features.x" not in runtime["entries"]

    # The admin interface listens on loopback only.
    listening = [
        c.laddr
        for c in psutil.Process(envoy.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert {a.ip for a in listening if a.port == admin} == {"127.0.0.1"}

    # The preStop hook's drain stops the data plane and leaves the probe listener.
    assert (
        httpx.post(
            f"http://127.0.0.1:{admin}/drain_listeners?graceful&inboundonly", timeout=5
        ).status_code
        == 200
    )

    def data_plane_closed() -> bool:
        try:
            httpx.get(f"http://127.0.0.1:{listen}/", timeout=2)
        except httpx.ConnectError:
            return True
        except (httpx.RemoteProtocolError, httpx.ReadError):
            return False  # still draining: accepted, then closed or reset unanswered
        return False

    wait_until(data_plane_closed, 30, "the drained data-plane listener closed")
    assert _status(f"{probes}/ready") == 200
