"""Redis with ACL credentials, as deploy/k8s/ and compose/ run it, with the real components.

``deploy/k8s/redis-secret.sh`` makes the Secret (the URL the components read and the ACL
file of Redis); a real Redis runs with that ACL, and a real control plane and ext_proc
read the URL from a file (``--redis-url-file``, the mounted Secret). The control plane
seeds the shared state, ext_proc follows it and counts a routed request through its Lua
script: every command they use passes the ACL. Anyone else gets nothing but PING. The
same again over TLS (``rediss://``), the documented option.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse
import uuid
from pathlib import Path

import grpc
import pytest
import redis
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.servicer import PROCESS_PATH
from prefix_router.ops.launch import start_ext_proc, start_module
from prefix_router.ops.procs import ManagedProcess, cli_command, free_port
from tests.conftest import ProcessReaper
from tests.support.wait import wait_until
from tests.test_deploy_cli_contract import ROOT
from tests.test_deploy_compose import COMPOSE_DIR

SECRET_SCRIPT = ROOT / "deploy" / "k8s" / "redis-secret.sh"


def make_secret() -> dict[str, str]:
    result = subprocess.run(
        ["sh", str(SECRET_SCRIPT)], capture_output=True, text=True, timeout=30, check=True
    )
    secret = yaml.safe_load(result.stdout)
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "prefix-router-redis"
    data: dict[str, str] = secret["stringData"]
    return data


def test_the_secret_script_makes_a_fresh_password_that_url_and_acl_share() -> None:
    first, second = make_secret(), make_secret()
    url = urllib.parse.urlsplit(first["url"])
    assert (url.scheme, url.username, url.hostname, url.port, url.path) == (
        "redis",
        "prefix-router",
        "redis",
        6379,
        "/0",
    )
    assert url.password and len(url.password) == 64
    assert first["users.acl"].splitlines() == [
        "user default on nopass -@all +ping",
        f"user prefix-router on >{url.password} ~prefix-router:* &prefix-router:* "
        "+@all -@dangerous",
    ]
    assert urllib.parse.urlsplit(second["url"]).password != url.password


def test_the_script_writes_the_same_pair_as_files_for_an_overlay(tmp_path: Path) -> None:
    """``--files DIR``: what an overlay's secretGenerator reads (the documented install),
    readable by its owner only."""
    subprocess.run(["sh", str(SECRET_SCRIPT), "--files", str(tmp_path)], check=True, timeout=30)
    url = urllib.parse.urlsplit((tmp_path / "redis-url").read_text().strip())
    assert (url.scheme, url.username, url.hostname) == ("redis", "prefix-router", "redis")
    assert url.password and len(url.password) == 64
    assert (tmp_path / "redis-users.acl").read_text().splitlines() == [
        "user default on nopass -@all +ping",
        f"user prefix-router on >{url.password} ~prefix-router:* &prefix-router:* "
        "+@all -@dangerous",
    ]
    for name in ("redis-url", "redis-users.acl"):
        assert (tmp_path / name).stat().st_mode & 0o077 == 0


def test_compose_dev_credentials_agree() -> None:
    url = urllib.parse.urlsplit((COMPOSE_DIR / "redis-url.dev").read_text().strip())
    acl = (COMPOSE_DIR / "redis-users.acl.dev").read_text().splitlines()
    assert acl[0] == "user default on nopass -@all +ping"
    assert acl[1].startswith(f"user {url.username} on >{url.password} ~prefix-router:* ")


def _route_one_request(port: int) -> pb.ProcessingResponse:
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            ]
        )
    )
    body = pb.HttpBody(body=b'{"model": "m", "prompt": "hello through an ACL"}', end_of_stream=True)
    messages = [
        pb.ProcessingRequest(request_headers=headers).SerializeToString(),
        pb.ProcessingRequest(request_body=body).SerializeToString(),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            PROCESS_PATH, request_serializer=None, response_deserializer=None
        )
        answers = [pb.ProcessingResponse.FromString(a) for a in call(iter(messages), timeout=10)]
    return answers[-1]


def _tls_files(directory: Path) -> dict[str, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl, as an operator would)."""
    files = {name: directory / name for name in ("ca.key", "ca.pem", "key", "csr", "crt", "ext")}
    files["ext"].write_text("subjectAltName=IP:127.0.0.1\n")
    for argv in (
        [
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            files["ca.key"],
            "-out",
            files["ca.pem"],
            "-days",
            "2",
            "-subj",
            "/CN=prefix-router test CA",
        ],
        [
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            files["key"],
            "-out",
            files["csr"],
            "-subj",
            "/CN=127.0.0.1",
        ],
        [
            "x509",
            "-req",
            "-in",
            files["csr"],
            "-CA",
            files["ca.pem"],
            "-CAkey",
            files["ca.key"],
            "-CAcreateserial",
            "-out",
            files["crt"],
            "-days",
            "2",
            "-extfile",
            files["ext"],
        ],
    ):
        subprocess.run(["openssl", *map(str, argv)], capture_output=True, timeout=60, check=True)
    return files


def _start_redis(
    procs: ProcessReaper, log_dir: Path, acl: Path, tls: dict[str, Path] | None
) -> int:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is installed by scripts/ensure-test-services"
    port = free_port()
    listen = ["--port", str(port)]
    if tls is not None:
        listen = [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(tls["crt"]),
            "--tls-key-file",
            str(tls["key"]),
            "--tls-ca-cert-file",
            str(tls["ca.pem"]),
            "--tls-auth-clients",
            "no",
        ]
    procs.add(
        ManagedProcess(
            "redis",
            [
                binary,
                *listen,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--aclfile",
                str(acl),
            ],
            log_dir / "redis.log",
        ).start()
    )
    return port


@pytest.mark.e2e
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_components_work_through_the_acl_and_nobody_else_gets_in(
    procs: ProcessReaper, log_dir: Path, tmp_path: Path, tls: bool
) -> None:
    """With ``tls``: ``rediss://`` and the CA in the URL (docs/deployment.md, TLS)."""
    secret = make_secret()
    acl = tmp_path / "users.acl"
    acl.write_text(secret["users.acl"])
    certs = _tls_files(tmp_path) if tls else None
    port = _start_redis(procs, log_dir, acl, certs)
    url = urllib.parse.urlsplit(secret["url"])
    local = url._replace(netloc=f"{url.username}:{url.password}@127.0.0.1:{port}")
    if certs is not None:
        local = local._replace(
            scheme="rediss", query=f"ssl_cert_reqs=required&ssl_ca_certs={certs['ca.pem']}"
        )
    local_url = local.geturl()
    user = redis.Redis.from_url(local_url, socket_timeout=5)

    def answers() -> bool:
        try:
            return bool(user.ping())
        except redis.exceptions.ConnectionError:
            return False

    wait_until(answers, 30, "redis answers")
    url_file = tmp_path / "url"
    url_file.write_text(local_url + "\n")
    namespace = f"prefix-router:test-{uuid.uuid4().hex[:12]}:"  # under the ACL's prefix
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"instances": [{"address": "127.0.0.1", "port": 9}]}))

    xds, admin = free_port(), free_port()
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
                "--redis-url-file",
                str(url_file),
                "--namespace",
                namespace,
                "--fleet",
                str(fleet),
                "--fleet-scrape-interval",
                "0",
                "--no-health-probe",
            ],
            log_dir,
            ready_ports=[xds, admin],
            env={"PREFIX_ROUTER_ADMIN_TOKEN": "t"},
        )
    )
    ext_proc_port = free_port()
    procs.add(
        start_ext_proc(
            ext_proc_port,
            log_dir,
            args=["--redis-url-file", str(url_file), "--namespace", namespace],
        )
    )

    def routed() -> bool:
        mutation = _route_one_request(ext_proc_port).request_body.response.header_mutation
        return [h.header.key for h in mutation.set_headers] == ["x-prefix-key"]

    # ext_proc has no fleet of its own: a key means it read the control plane's from Redis.
    wait_until(routed, 30, "ext_proc routes with the fleet it read through the ACL")
    anonymous = redis.Redis.from_url(
        local._replace(netloc=f"127.0.0.1:{port}").geturl(), socket_timeout=5
    )
    try:
        assert user.exists(f"{namespace}fleet", f"{namespace}config") == 2
        # The routed request went through ext_proc's Lua script (its decision counted).
        wait_until(lambda: user.exists(f"{namespace}decisions"), 30, "the decision is counted")
        assert anonymous.ping()
        for forbidden in (
            lambda: anonymous.get(f"{namespace}fleet"),
            lambda: anonymous.set("x", 1),
            lambda: user.set("outside-the-namespace", 1),
            lambda: user.flushall(),
            lambda: user.keys("*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
    finally:
        for key in user.scan_iter(match=f"{namespace}*"):
            user.delete(key)
        user.close()
        anonymous.close()


@pytest.mark.parametrize("command", ["ext-proc", "control-plane"])
def test_an_empty_url_file_stops_the_component_at_start(tmp_path: Path, command: str) -> None:
    """The Secret's placeholder is empty: nothing starts against an unauthenticated Redis."""
    empty = tmp_path / "url"
    empty.write_text("")
    result = subprocess.run(
        cli_command(
            command,
            "--port" if command == "ext-proc" else "--xds-port",
            str(free_port()),
            "--redis-url-file",
            str(empty),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert f"--redis-url-file {empty} is empty" in result.stderr
