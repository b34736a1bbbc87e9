"""compose/docker-compose.yml, checked without a Docker engine.

* ``docker-compose config`` (Compose v1, Debian's ``docker-compose``, which
  scripts/ensure-test-services installs) validates and resolves the file;
* in Python: every container command is a real ``prefix-router`` subcommand with real
  flags, the ports and names one service uses to reach another match what that service
  listens on, the fleets list the simulated/vLLM containers' addresses, every mounted file
  exists, Envoy's admin stays on loopback and Redis takes ACL credentials from secrets;
* the healthcheck snippets run against real processes (here for ext_proc and the
  simulator, and against hung ones in tests/test_deploy_probes.py);
* the Dockerfile copies what the package needs and runs as a non-root user.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from control_plane.server import load_fleet_file
from prefix_router.core.config import load_config_file
from prefix_router.ops.bootstrap_cli import build as build_bootstrap
from prefix_router.ops.bootstrap_cli import parse_host_port
from prefix_router.ops.envoy_run import STOP_WAIT_S
from prefix_router.ops.launch import start_ext_proc, start_module
from prefix_router.ops.procs import free_port
from tests.conftest import ProcessReaper
from tests.test_deploy_cli_contract import (
    ROOT,
    ParsedArgs,
    interpolate,
    parse_cli,
    parse_envoy,
    parse_shell,
)

COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
SIMS = ("sim-1", "sim-2", "sim-3", "sim-4")
VLLMS = ("vllm-1", "vllm-2")
OUR_IMAGE_SERVICES = ("control-plane", "ext-proc", "envoy", *SIMS)
ENVS: dict[str, dict[str, str]] = {
    "defaults": {},
    "gpu": {"FLEET_FILE": "fleet-gpu.yaml", "MODEL": "org/some-model", "EXT_PROC_REPLICAS": "4"},
}


def _interpolated(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolated(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _interpolated(v, env) for k, v in node.items()}
    return node


def load_compose(env: dict[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(raw, dict)
    return {k: v for k, v in _interpolated(raw, env).items() if not k.startswith("x-")}


@pytest.fixture(params=sorted(ENVS))
def compose(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_compose(ENVS[request.param])


def _service_args(service: dict[str, Any]) -> list[list[str]]:
    """The argv of every program the container runs, with the entrypoint applied."""
    command = service["command"]
    entrypoint = service.get("entrypoint")
    if entrypoint == ["/bin/sh", "-c"]:
        assert isinstance(command, list) and len(command) == 1
        return [part for argv in parse_shell(command[0]) for part in _unwrapped(argv)]
    assert entrypoint is None, f"unexpected entrypoint {entrypoint}"
    return [["prefix-router", *map(str, command)]]


def _unwrapped(argv: list[str]) -> list[list[str]]:
    """``prefix-router envoy-run OPTIONS -- envoy ARGS`` -> its own argv and Envoy's."""
    if argv[:2] != ["prefix-router", "envoy-run"]:
        return [argv]
    assert "--" in argv, f"envoy-run without a command: {argv}"
    at = argv.index("--")
    return [argv[:at], argv[at + 1 :]]


def _cli(compose: dict[str, Any], name: str) -> tuple[str, ParsedArgs]:
    (argv,) = _service_args(compose["services"][name])
    assert argv[0] == "prefix-router"
    return parse_cli(argv[1:])


def _seconds(duration: str) -> float:
    """A compose duration (``10m``, ``90s``, ``1m30s``) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def _container_path(service: dict[str, Any], path: str) -> Path:
    """The host file a container path is bind-mounted from (volumes or secrets)."""
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if path == target or path.startswith(target.rstrip("/") + "/"):
            assert source.startswith("./"), f"{volume} is not a bind mount"
            return COMPOSE_DIR / source / Path(path).relative_to(target)
    raise AssertionError(f"{path} is not mounted into the container")


def _published(service: dict[str, Any]) -> dict[int, str]:
    """container port -> host side of every ``ports`` entry."""
    out = {}
    for spec in service.get("ports", []):
        host, _, container = str(spec).rpartition(":")
        out[int(container)] = host
    return out


def _healthcheck_port(service: dict[str, Any]) -> int:
    (port,) = set(re.findall(r"127\.0\.0\.1:(\d+)", " ".join(service["healthcheck"]["test"])))
    return int(port)


# -- docker-compose itself -----------------------------------------------------------------


@pytest.mark.parametrize("profiles", [(), ("gpu", "observability")])
@pytest.mark.parametrize("env_name", sorted(ENVS))
def test_docker_compose_config_accepts_the_file(profiles: tuple[str, ...], env_name: str) -> None:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: scripts/ensure-test-services installs it"
    args = [binary, "-f", str(COMPOSE_FILE)]
    for profile in profiles:
        args += ["--profile", profile]
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(Path.home()), **ENVS[env_name]}
    result = subprocess.run([*args, "config"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    assert set(resolved) == {"redis", *OUR_IMAGE_SERVICES, *VLLMS, "prometheus", "grafana"}
    assert {n for n, s in resolved.items() if s.get("profiles")} == {
        *VLLMS,
        "prometheus",
        "grafana",
    }
    expected_fleet = ENVS[env_name].get("FLEET_FILE", "fleet.yaml")
    assert f"--fleet=/etc/prefix-router/{expected_fleet}" in resolved["control-plane"]["command"]
    secrets = yaml.safe_load(result.stdout)["secrets"]
    for name, source in (("redis_url", "redis-url.dev"), ("redis_acl", "redis-users.acl.dev")):
        assert Path(secrets[name]["file"]) == COMPOSE_DIR / source


def test_docker_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    """The check above can fail: a misspelt healthcheck key is refused."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: scripts/ensure-test-services installs it"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("start_period: 10s", "start_perod: 10s"))
    result = subprocess.run(
        [binary, "-f", str(broken), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "start_perod" in result.stderr


# -- structure, always ---------------------------------------------------------------------


def test_services_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *OUR_IMAGE_SERVICES, *VLLMS, "prometheus", "grafana"}
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services.items()}
    assert {n for n, p in profiles.items() if p == ("gpu",)} == set(VLLMS)
    assert {n for n, p in profiles.items() if p == ("observability",)} == {"prometheus", "grafana"}
    assert all(not profiles[n] for n in ("redis", *OUR_IMAGE_SERVICES))
    for name in OUR_IMAGE_SERVICES:
        build = services[name]["build"]
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == (
            ROOT / "Dockerfile"
        )
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        for dep in service.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"


def test_ext_proc_replicas_are_settable() -> None:
    raw = COMPOSE_FILE.read_text()
    assert "replicas: ${EXT_PROC_REPLICAS:-2}" in raw
    assert load_compose({})["services"]["ext-proc"]["deploy"]["replicas"] == "2"
    assert load_compose({"EXT_PROC_REPLICAS": "5"})["services"]["ext-proc"]["deploy"] == {
        "replicas": "5"
    }
    ext_proc = load_compose({})["services"]["ext-proc"]
    assert "container_name" not in ext_proc and "ports" not in ext_proc  # would block scaling


def test_every_command_is_a_real_subcommand_with_real_flags(compose: dict[str, Any]) -> None:
    for name in OUR_IMAGE_SERVICES:
        for argv in _service_args(compose["services"][name]):
            if argv[0] == "envoy":
                parse_envoy(argv[1:])
            else:
                assert argv[0] == "prefix-router", f"{name} runs {argv[0]}"
                parse_cli(argv[1:])


def test_control_plane_and_envoy_agree(compose: dict[str, Any]) -> None:
    services = compose["services"]
    _, cp = _cli(compose, "control-plane")
    bootstrap_argv, run_argv, envoy_argv = _service_args(services["envoy"])
    _, boot = parse_cli(bootstrap_argv[1:])
    _, run = parse_cli(run_argv[1:])
    envoy = parse_envoy(envoy_argv[1:])

    # Envoy reaches the control plane's xDS port by its service name.
    assert parse_host_port(boot.one("--xds")) == ("control-plane", int(cp.one("--xds-port")))
    assert cp.one("--xds-host") == "0.0.0.0" and cp.one("--admin-host") == "0.0.0.0"
    assert _healthcheck_port(services["control-plane"]) == int(cp.one("--metrics-port"))
    assert "/healthz" in " ".join(services["control-plane"]["healthcheck"]["test"])
    assert int(cp.one("--admin-port")) in _published(services["control-plane"])
    # Envoy runs the bootstrap it rendered.
    assert envoy.one("-c") == boot.one("--out")
    # The published data port and the healthchecked probe port are Envoy's; its admin
    # interface stays on loopback inside the container and is published nowhere.
    assert int(boot.one("--listen-port")) in _published(services["envoy"])
    assert _published(services["envoy"])[int(boot.one("--probe-port"))].startswith("127.0.0.1:")
    assert int(boot.one("--admin-port")) not in _published(services["envoy"])
    assert _healthcheck_port(services["envoy"]) == int(boot.one("--probe-port"))
    assert "/ready" in " ".join(services["envoy"]["healthcheck"]["test"])
    assert boot.one("--listen-address") == boot.one("--probe-address") == "0.0.0.0"
    assert boot.one("--admin-address") == "127.0.0.1"
    # On `docker compose down` envoy-run drains Envoy through its admin (Envoy refuses new
    # connections once its drain time is over), docker's init passes the SIGTERM on, and
    # docker waits longer than the drain may take before it kills the container: the
    # timeout, a last admin exchange (7 s at most) and Envoy's own exit.
    admin = f"{boot.one('--admin-address')}:{boot.one('--admin-port')}"
    assert run.one("--admin") == admin
    assert float(envoy.one("--drain-time-s")) <= 5
    assert services["envoy"]["init"] is True
    grace = _seconds(services["envoy"]["stop_grace_period"])
    assert grace >= float(run.one("--timeout")) + 7 + STOP_WAIT_S + 3
    assert "$HOSTNAME" in boot.one("--node-id")  # one node id per Envoy container
    # Both read the same routing config, from a file that exists and validates.
    config = _container_path(services["control-plane"], cp.one("--config"))
    assert config == _container_path(services["envoy"], boot.one("--config"))
    load_config_file(str(config))
    for fleet in ("fleet.yaml", "fleet-gpu.yaml"):
        load_fleet_file(str(COMPOSE_DIR / fleet))


def test_ext_proc_matches_envoy_and_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    _, xp = _cli(compose, "ext-proc")
    _, cp = _cli(compose, "control-plane")
    bootstrap_argv, *_ = _service_args(services["envoy"])
    _, boot = parse_cli(bootstrap_argv[1:])
    assert [parse_host_port(v) for v in boot.options["--ext-proc"]] == [
        ("ext-proc", int(xp.one("--port")))
    ]
    assert xp.one("--host") == "0.0.0.0"
    assert _healthcheck_port(services["ext-proc"]) == int(xp.one("--port"))
    assert "--metrics-port" in xp.options
    # ext_proc follows the control plane's state: same Redis, same namespace, and the URL
    # (user and password) from one secret file, never on the command line.
    assert xp.one("--redis-url-file") == cp.one("--redis-url-file") == "/run/secrets/redis_url"
    assert "--redis-url" not in xp.options and "--redis-url" not in cp.options
    assert "redis_url" in services["ext-proc"]["secrets"]
    assert "redis_url" in services["control-plane"]["secrets"]
    url = urllib.parse.urlsplit(
        (COMPOSE_DIR / compose["secrets"]["redis_url"]["file"]).read_text().strip()
    )
    assert (url.hostname, url.port) == ("redis", 6379) and url.username and url.password
    assert xp.one("--namespace") == cp.one("--namespace")
    # Redis: the ACL from the other secret file; the default user may only PING.
    redis = services["redis"]
    command = redis["command"]
    acl = command[command.index("--aclfile") + 1]
    assert acl == "/run/secrets/redis_acl" and redis["secrets"] == ["redis_acl"]
    lines = (COMPOSE_DIR / compose["secrets"]["redis_acl"]["file"]).read_text().splitlines()
    assert lines[0] == "user default on nopass -@all +ping"
    assert f"{url.username} on >{url.password} " in lines[1]


def test_rendered_bootstrap_uses_dns_clusters(compose: dict[str, Any]) -> None:
    """What the envoy container renders at start, rendered here from the same flags."""
    services = compose["services"]
    bootstrap_argv, *_ = _service_args(services["envoy"])
    argv = list(bootstrap_argv[2:])
    config_at = argv.index("--config") + 1
    argv[config_at] = str(_container_path(services["envoy"], argv[config_at]))
    out_at = argv.index("--out")
    del argv[out_at : out_at + 2]
    params, _, fleet, out = build_bootstrap(argv, {})
    assert fleet is None and out is None and params.xds == ("control-plane", 18000)
    assert params.ext_proc == (("ext-proc", 50051),)


def test_control_plane_token_comes_from_a_secret_file(compose: dict[str, Any]) -> None:
    service = compose["services"]["control-plane"]
    _, cp = _cli(compose, "control-plane")
    token_path = cp.one("--token-file")
    assert token_path.startswith("/run/secrets/")
    secret = token_path.removeprefix("/run/secrets/")
    assert secret in service["secrets"]
    token_file = COMPOSE_DIR / compose["secrets"][secret]["file"]
    assert token_file.is_file() and token_file.read_text().strip()


def _fleet_addresses(path: Path) -> list[tuple[str, int]]:
    data = yaml.safe_load(path.read_text())
    return [(i["address"], int(i["port"])) for i in data["instances"]]


def _container_addresses(compose: dict[str, Any], names: tuple[str, ...]) -> list[tuple[str, int]]:
    out = []
    for name in names:
        service = compose["services"][name]
        address = service["networks"]["router"]["ipv4_address"]
        ports = [
            a.removeprefix("--ports=").removeprefix("--port=")
            for a in service["command"]
            if a.startswith(("--ports=", "--port="))
        ]
        assert len(ports) == 1, f"{name}: one --port/--ports=PORT"
        out.append((address, int(ports[0])))
        assert _healthcheck_port(service) == int(ports[0])
    return out


def test_fleet_files_list_the_instance_containers(compose: dict[str, Any]) -> None:
    """Envoy takes EDS endpoints as IPs only, so the fleets name the containers' fixed IPs."""
    service = compose["services"]["control-plane"]
    _, cp = _cli(compose, "control-plane")
    fleet = _container_path(service, cp.one("--fleet"))
    assert fleet.is_file()
    assert sorted(_fleet_addresses(COMPOSE_DIR / "fleet.yaml")) == sorted(
        _container_addresses(compose, SIMS)
    )
    assert sorted(_fleet_addresses(COMPOSE_DIR / "fleet-gpu.yaml")) == sorted(
        _container_addresses(compose, VLLMS)
    )
    for path in ("fleet.yaml", "fleet-gpu.yaml"):  # the hostname is noted beside each address
        for line in (COMPOSE_DIR / path).read_text().splitlines():
            if line.startswith("- {address:"):
                assert line.split("#")[1].strip() in (*SIMS, *VLLMS)
    ipam = compose["networks"]["router"]["ipam"]["config"][0]
    subnet = ipaddress.ip_network(ipam["subnet"])
    dynamic = ipaddress.ip_network(ipam["ip_range"])
    for address, _ in _container_addresses(compose, (*SIMS, *VLLMS)):
        ip = ipaddress.ip_address(address)
        assert ip in subnet and ip not in dynamic, f"{ip}: in {subnet}, outside {dynamic}"


def test_gpu_services_reserve_a_gpu_and_cache_prefixes(compose: dict[str, Any]) -> None:
    raw = COMPOSE_FILE.read_text()
    assert "--model=${MODEL" in raw
    for name in VLLMS:
        service = compose["services"][name]
        assert service["image"].startswith("vllm/vllm-openai:")
        assert "--enable-prefix-caching" in service["command"]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    gpus = [
        compose["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for n in VLLMS
    ]
    assert len({tuple(g) for g in gpus}) == len(VLLMS), "each vLLM gets its own GPU"
    assert load_compose({"MODEL": "m/x"})["services"]["vllm-1"]["command"][0] == "--model=m/x"


def test_sims_are_simulated_vllm(compose: dict[str, Any]) -> None:
    for name in SIMS:
        command, args = _cli(compose, name)
        assert command == "sim" and args.one("--host") == "0.0.0.0"


def test_bind_mounts_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"


def test_prometheus_scrapes_every_component(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prom = services["prometheus"]
    config_path = _container_path(prom, "/etc/prometheus/prometheus.yml")
    assert f"--config.file={'/etc/prometheus/prometheus.yml'}" in prom["command"]
    config = yaml.safe_load(config_path.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    _, xp = _cli(compose, "ext-proc")
    _, cp = _cli(compose, "control-plane")
    (dns,) = jobs["ext-proc"]["dns_sd_configs"]
    assert dns["names"] == ["ext-proc"] and dns["port"] == int(xp.one("--metrics-port"))
    assert jobs["control-plane"]["static_configs"][0]["targets"] == [
        f"control-plane:{cp.one('--metrics-port')}"
    ]
    sims = jobs["vllm-sim"]["static_configs"][0]["targets"]
    assert sorted(sims) == sorted(
        f"{n}:{p}" for n, (_, p) in zip(SIMS, _container_addresses(compose, SIMS), strict=True)
    )
    vllms = jobs["vllm"]["static_configs"][0]["targets"]
    assert sorted(vllms) == sorted(
        f"{n}:{p}" for n, (_, p) in zip(VLLMS, _container_addresses(compose, VLLMS), strict=True)
    )
    assert jobs["envoy"]["static_configs"][0]["targets"] == [
        f"envoy:{_healthcheck_port(services['envoy'])}"
    ]
    for job in jobs.values():
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                assert target.split(":")[0] in services


def test_grafana_provisions_the_datasource_and_dashboards_folder(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    provisioning = _container_path(grafana, "/etc/grafana/provisioning")
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    prom_port = next(iter(_published(compose["services"]["prometheus"])))
    assert datasource["url"] == f"http://prometheus:{prom_port}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "prefix-router.yml").read_text())[
        "providers"
    ]
    dashboards = _container_path(grafana, provider["options"]["path"])
    assert dashboards == COMPOSE_DIR / "grafana" / "dashboards" and dashboards.is_dir()
    assert datasource["uid"] == "prometheus" and datasource["isDefault"] is True
    boards = list(dashboards.glob("*.json"))
    assert boards, "no dashboard to provision"
    for path in boards:  # whatever is there loads with this datasource
        uids = set(re.findall(r'"uid":\s*"([^"]*)"', path.read_text()))
        json.loads(path.read_text())
        assert not any(u.startswith("${") and u != "${datasource}" for u in uids), path


def test_our_healthchecks_need_an_answer_and_end_before_docker_kills_them(
    compose: dict[str, Any],
) -> None:
    """Each asks the process itself (gRPC Check, HTTP, PING) with its own deadline below
    the healthcheck's ``timeout``; tests/test_deploy_probes.py runs them against hung
    processes."""
    for name in ("redis", *OUR_IMAGE_SERVICES):
        check = compose["services"][name]["healthcheck"]
        assert check["test"][0] == "CMD", f"{name}: exec form"
        command = " ".join(check["test"][1:])
        assert "ping" in command or "Check(" in command or "urlopen(" in command, name
        deadlines = [float(s) for s in re.findall(r"timeout[ =](\d+)", command)]
        assert deadlines and max(deadlines) < float(check["timeout"].rstrip("s")), name


# -- the healthcheck snippets, run for real --------------------------------------------------


def _run_healthcheck(service: dict[str, Any], port: int, real_port: int) -> int:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] in ("python", "python3")
    argv = [
        sys.executable,
        *(a.replace(f"127.0.0.1:{port}", f"127.0.0.1:{real_port}") for a in test[2:]),
    ]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


@pytest.mark.e2e
def test_grpc_and_http_healthchecks_work(procs: ProcessReaper, log_dir: Path) -> None:
    services = load_compose({})["services"]
    ext_proc_port, sim_port = free_port(), free_port()
    # Nothing listens yet: the checks fail.
    assert _run_healthcheck(services["ext-proc"], 50051, ext_proc_port) != 0
    procs.add(start_ext_proc(ext_proc_port, log_dir, args=["--backend", "127.0.0.1:1"]))
    procs.add(
        start_module("sim", "vllm_sim", ["--ports", str(sim_port)], log_dir, ready_ports=[sim_port])
    )
    assert _run_healthcheck(services["ext-proc"], 50051, ext_proc_port) == 0
    assert _run_healthcheck(services["sim-1"], 8000, sim_port) == 0


# -- the image ---------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    lines, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            instruction, _, rest = current.strip().partition(" ")
            lines.append((instruction.upper(), rest))
            current = ""
    return lines


def test_dockerfile_builds_one_image_for_every_command() -> None:
    instructions = _dockerfile()
    froms = [rest for op, rest in instructions if op == "FROM"]
    assert froms and all(f.split()[0] == "python:3.11-slim" for f in froms)
    entrypoint = [rest for op, rest in instructions if op == "ENTRYPOINT"]
    assert entrypoint == ['["prefix-router"]']
    (user,) = [rest for op, rest in instructions if op == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    copies = [rest.split() for op, rest in instructions if op == "COPY" and "--from" not in rest]
    sources = {src for *srcs, _ in copies for src in srcs}
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
    pyproject = (ROOT / "pyproject.toml").read_text()
    for package in ("prefix_router", "ext_proc", "control_plane", "vllm_sim"):
        assert package in sources and f'"{package}*"' in pyproject
    # Installed (not editable), the template is read from the package, where
    # prefix_router/envoy/bootstrap.yaml links to envoy/bootstrap.yaml: both must be copied.
    assert ["envoy", "envoy"] in copies
    assert (ROOT / "prefix_router" / "envoy" / "bootstrap.yaml").resolve() == (
        ROOT / "envoy" / "bootstrap.yaml"
    ).resolve()
    assert any("pip install /src" in rest for op, rest in instructions if op == "RUN")


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    rules = [
        r.strip()
        for r in (ROOT / ".dockerignore").read_text().splitlines()
        if r.strip() and not r.startswith("#")
    ]
    assert rules[0] == "*"
    allowed = {r.removeprefix("!").rstrip("/") for r in rules if r.startswith("!")}
    copies = [
        rest.split()[:-1] for op, rest in _dockerfile() if op == "COPY" and "--from" not in rest
    ]
    for src in (s for srcs in copies for s in srcs):
        assert src in allowed, f"COPY {src} is excluded by .dockerignore"
