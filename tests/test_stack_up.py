"""``prefix-router up``: settings precedence, one-line errors, and a clean stop."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from control_plane.http_server import MAX_CONNECTIONS
from control_plane.server import _parser as control_plane_parser
from prefix_router.core.errors import ConfigError
from prefix_router.ops.launch import start_module
from prefix_router.ops.procs import free_port
from prefix_router.ops.up import Stack, resolve_settings
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.processes import UpProcess, run_group, run_up
from tests.support.running_stack import running_stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    settings_file = tmp_path / "up.yaml"
    settings_file.write_text("port: 7001\nadmin_port: 7002\next_procs: 3\n")
    env = {"PREFIX_ROUTER_PORT": "7101", "PREFIX_ROUTER_EXT_PROCS": "4"}
    settings, _ = resolve_settings(["--settings", str(settings_file), "--port", "7201"], env)
    assert (settings.port, settings.ext_procs, settings.admin_port) == (7201, 4, 7002)


def test_what_each_simulator_serves_is_a_repeated_flag_or_a_semicolon_list() -> None:
    flags, _ = resolve_settings(["--sim-serve", "base-a", "--sim-serve", "base-b,b-sql"], {})
    env, _ = resolve_settings([], {"PREFIX_ROUTER_SIM_SERVE": "base-a;base-b,b-sql"})
    backends = {"PREFIX_ROUTER_BACKEND": "http://a:8000#llama,llama-lora;http://b:8000"}
    assert resolve_settings([], backends)[0].backend == [  # a model list keeps its commas
        "http://a:8000#llama,llama-lora",
        "http://b:8000",
    ]
    assert flags.sim_serve == env.sim_serve == ["base-a", "base-b,b-sql"]


def test_invalid_settings_are_one_clear_message(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ext_procs"):
        resolve_settings(["--ext-procs", "0"], {})
    with pytest.raises(ConfigError, match="must differ"):
        resolve_settings(["--port", "9000", "--admin-port", "9000"], {})
    with pytest.raises(ConfigError, match="IPv4"):
        resolve_settings(["--host", "localhost"], {})
    with pytest.raises(ConfigError, match="IPv4"):
        resolve_settings(["--host", "::1"], {})
    with pytest.raises(ConfigError, match="redis://"):
        resolve_settings(["--redis-url", "127.0.0.1:6379"], {})
    bad = tmp_path / "routing.yaml"
    bad.write_text("routing:\n  prefix_length: 0\n")
    with pytest.raises(ConfigError, match="prefix_length"):
        resolve_settings(["--config", str(bad)], {})


@pytest.mark.parametrize(
    ("args", "scale"),
    [
        ([], 1.0),
        (["--sim-time-scale", "4"], 4.0),  # the router's clocks run as its simulators do
        (["--backend", "http://10.0.0.1:8000", "--sim-time-scale", "4"], 1.0),  # real vLLM
        (["--backend", "http://10.0.0.1:8000", "--clock-scale", "0.25"], 0.25),
        (["--sim-time-scale", "4", "--clock-scale", "2"], 2.0),
    ],
)
def test_the_routers_clock_runs_at_its_instances_speed(args: list[str], scale: float) -> None:
    settings, _ = resolve_settings(args, {})
    assert settings.instance_clock_scale == scale


def test_a_clock_scale_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="clock_scale"):
        resolve_settings(["--clock-scale", "0"], {})


@pytest.mark.parametrize(
    ("args", "environ", "cap"),
    [
        ([], {}, MAX_CONNECTIONS),  # unset: the control plane's own default
        (["--http-max-connections", "5"], {}, 5),
        ([], {"PREFIX_ROUTER_HTTP_MAX_CONNECTIONS": "7"}, 7),
    ],
)
def test_the_admin_ports_connection_cap_reaches_the_control_plane(
    args: list[str], environ: dict[str, str], cap: int
) -> None:
    settings, config = resolve_settings(["--redis-url", REDIS_URL, *args], environ)
    argv = Stack(settings, config).control_plane_args(Path("fleet.yaml"))
    parsed = control_plane_parser().parse_args(argv)  # what the control plane would run with
    assert parsed.http_max_connections == cap
    assert (parsed.admin_port, parsed.xds_port, parsed.redis_url) == (8081, 18000, REDIS_URL)


def test_a_connection_cap_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="http_max_connections"):
        resolve_settings(["--http-max-connections", "0"], {})


def chat(client: httpx.Client, port: int) -> httpx.Response:
    body = {
        "model": "meta-llama/Llama-3.1-70B-Instruct",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)


def in_time_wait(port: int) -> bool:
    """A plain bind (no SO_REUSEADDR) fails: a connection on ``port`` is in TIME_WAIT."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_up_serves_stops_cleanly_and_starts_again_at_once(namespace: str, tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    args = [
        "--run-dir",
        str(tmp_path / "run"),
        "--instances",
        "2",
        "--ext-procs",
        "1",
        "--sim-time-scale",
        "50",
        "--redis-url",
        REDIS_URL,
        "--namespace",
        namespace,
    ]
    for name, port in ports.items():
        args += [f"--{name}", str(port)]
    with UpProcess(args, tmp_path / "up.out") as up:
        banner = up.wait_up()
        assert "admin token" in banner
        assert len(up.track()) >= 5  # up, sim, control plane, ext_proc, envoy
        with httpx.Client(timeout=10) as client:
            assert chat(client, ports["port"]).status_code == 200
            run_readme_examples(banner, ports["port"], ports["admin-port"])
            code, output = run_up(args, tmp_path / "second.out")
            assert code == 2, output
            assert output.strip().splitlines() == [
                f"prefix-router up: already running (pid {up.pid}, lock "
                f"{tmp_path / 'run' / 'up.lock'}); stop it first"
            ]
            # stopped with the client's keep-alive connections open: Envoy closes them,
            # and they stay in TIME_WAIT on its listener port
            assert up.terminate() == 0
        assert up.leftovers() == []
        assert in_time_wait(ports["port"])

    # started again at once, on the same ports, with real traffic behind it
    with UpProcess(args, tmp_path / "again.out") as again:
        again.wait_up()
        with httpx.Client(timeout=10) as client:
            assert chat(client, ports["port"]).status_code == 200
        assert again.terminate() == 0
        assert again.leftovers() == []


def test_up_stops_everything_when_the_process_that_started_it_exits(
    namespace: str, tmp_path: Path
) -> None:
    """``--exit-with-parent`` (what ``make run`` passes): the parent killed outright, as a
    SIGTERM to make alone leaves its child, and up stops its stack and exits."""
    ports = {name: free_port() for name in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    args = ["--run-dir", str(tmp_path / "run"), "--instances", "1", "--ext-procs", "1"]
    args += ["--exit-with-parent", "true", "--namespace", namespace]
    for name, port in ports.items():
        args += [f"--{name}", str(port)]
    parent = UpProcess(args, tmp_path / "up.out")
    parent.argv = ["sh", "-c", '"$@" & wait', "sh", *parent.argv]  # up as sh's child
    with parent:
        parent.wait_up()
        assert len(parent.track()) >= 6  # sh, up, sim, control plane, ext_proc, envoy
        os.kill(parent.pid, signal.SIGKILL)
        assert parent.popen is not None
        parent.popen.wait(timeout=10)
        wait_until(lambda: parent.leftovers() == [], 30, "up and its stack to stop")
        assert f"parent {parent.pid} exited: stopping" in parent.output(), parent.output()


def test_a_signal_during_start_up_or_a_hangup_stops_everything_at_once(
    namespace: str, tmp_path: Path
) -> None:
    """Ctrl-C while up waits for a fleet still loading (it waits up to a minute) stops it
    at once; so does SIGHUP (a closed terminal), which once killed up and left its stack
    running."""
    ports = {name: free_port() for name in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    base = ["--run-dir", str(tmp_path / "run"), "--ext-procs", "1"]
    base += ["--redis-url", REDIS_URL, "--namespace", namespace]
    for name, port in ports.items():
        base += [f"--{name}", str(port)]
    loading = [*base, "--backend", f"http://127.0.0.1:{free_port()}"]  # nothing answers there
    with UpProcess(loading, tmp_path / "loading.out") as up:
        wait_until(lambda: len(up.track()) >= 4, 60, "the control plane, ext_proc and Envoy")
        assert up.popen is not None
        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(timeout=15) == 0
        wait_until(lambda: up.leftovers() == [], 15, "the stack to stop")
        assert "SIGINT during start-up" in up.output(), up.output()
    # Ctrl-C twice: the second lands in the clean-up the first started, which still ends
    with UpProcess(loading, tmp_path / "twice.out") as up:
        wait_until(lambda: len(up.track()) >= 4, 60, "the control plane, ext_proc and Envoy")
        assert up.popen is not None
        up.popen.send_signal(signal.SIGINT)
        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(timeout=15) == 0
        wait_until(lambda: up.leftovers() == [], 15, "the stack to stop")
        assert up.output().count("SIGINT during start-up") == 1, up.output()
    with UpProcess([*base, "--instances", "1"], tmp_path / "up.out") as up:
        up.wait_up()
        up.track()
        assert up.popen is not None
        up.popen.send_signal(signal.SIGHUP)
        assert up.popen.wait(timeout=30) == 0
        assert up.leftovers() == []


def test_a_taken_port_is_a_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = run_up(
            ["--run-dir", str(tmp_path / "run"), "--port", str(port)], tmp_path / "up.out"
        )
    assert code == 2
    assert output.strip().splitlines() == [
        f"prefix-router up: port {port} (--port) is taken: free it or choose another"
    ]


def test_routing_shortcuts_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text("routing:\n  prefix_length: 2048\n  concurrency_threshold: 8\n")
    env = {"PREFIX_ROUTER_CONCURRENCY_THRESHOLD": "24", "PREFIX_ROUTER_SPILL_POLICY": "none"}
    _, routing = resolve_settings(["--config", str(config), "--prefix-mode", "bytes"], env)
    assert routing.prefix_length == 2048
    assert routing.concurrency_threshold == 24
    assert routing.prefix_mode.value == "bytes"
    assert routing.spill.policy.value == "none"
    with pytest.raises(ConfigError, match="spill.policy"):
        resolve_settings(["--spill-policy", "sideways"], {})
    # ConcurrencyThreshold is off by default, and a flag turns a file's back off
    assert resolve_settings([], {})[1].concurrency_threshold is None
    _, routing = resolve_settings(["--config", str(config), "--concurrency-threshold", "off"], {})
    assert routing.concurrency_threshold is None and routing.prefix_length == 2048
    with pytest.raises(ConfigError, match="concurrency_threshold"):
        resolve_settings(["--concurrency-threshold", "lots"], {})


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def run_readme_examples(banner: str, port: int, admin_port: int) -> None:
    """The README's first request (curl and the openai client) and its admin API examples,
    run against this stack: only the ports differ."""
    token = re.search(r"admin token\s+(\S+)", banner)
    assert token is not None, banner
    env = {**os.environ, "TOKEN": token.group(1)}

    def localise(text: str) -> str:
        return text.replace("127.0.0.1:8080", f"127.0.0.1:{port}").replace(
            "127.0.0.1:8081", f"127.0.0.1:{admin_port}"
        )

    first_request = next(b for b in readme_blocks("sh") if "/v1/chat/completions" in b)
    answer = run_group(["bash", "-c", localise(first_request)], timeout=30)
    assert answer.returncode == 0 and '"choices"' in answer.stdout, answer
    client = readme_blocks("python")[0]
    printed = run_group([sys.executable, "-c", localise(client)], timeout=60)
    assert printed.returncode == 0 and printed.stdout.strip(), printed
    admin = next(b for b in readme_blocks("sh") if "/status" in b)
    for command in admin.replace("\\\n", " ").strip().splitlines():
        done = run_group(
            ["bash", "-c", localise(command) + " --fail-with-body -sS"], timeout=30, env=env
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)


def test_up_with_simulators_serving_several_models_routes_by_pool(
    procs: ProcessReaper, tmp_path: Path
) -> None:
    """``--sim-serve`` per instance: the control plane discovers the pools, and each model's
    requests reach only the instances serving it."""
    serve = ["base-a", "base-a,a-sql", "base-b"]
    with running_stack(procs, tmp_path, instances=3, sim_serve=serve) as stack:
        ids = stack.instance_ids

        def pools() -> dict[str, list[str]]:
            with stack.admin() as admin:
                return dict(admin.get("/status").json()["models"]["pools"])

        wait_until(lambda: set(pools()) == {"base-a", "a-sql", "base-b"}, 30, "pools learned")
        port_of = {i: i.rsplit(":", 1)[1] for i in ids}
        found = pools()
        with httpx.Client(timeout=30) as client:

            def answered() -> bool:
                r = client.get(f"{stack.url}/v1/models")
                return r.status_code == 200 and len(r.json()["data"]) == 3

            wait_until(answered, 30, "ext_proc lists the fleet's models")
            for model, members in found.items():
                for n in range(6):
                    r = stack.chat(client, f"question {n}", model=model)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-sim-instance"] in {port_of[i] for i in members}
            unknown = stack.chat(client, "hi", model="base-c")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == 404


def test_up_stops_everything_when_no_one_reads_its_output_any_more(
    namespace: str, tmp_path: Path
) -> None:
    """``up 2>&1 | tee up.log`` and Ctrl-C: the reader goes first, and up's "stopping..."
    meets a broken pipe (a closed terminal gives EIO alike). That once ended up with a
    traceback before it stopped anything, leaving the stack running."""
    ports = {name: free_port() for name in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    args = ["--run-dir", str(tmp_path / "run"), "--instances", "1", "--ext-procs", "1"]
    args += ["--namespace", namespace]
    for name, port in ports.items():
        args += [f"--{name}", str(port)]
    piped = UpProcess(args, tmp_path / "up.out")
    # the reader copies up's lines until the banner's last one, then exits
    reader = 'sed -u "/Ctrl-C stops everything/q"'
    piped.argv = ["sh", "-c", f'"$@" 2>&1 | {reader}', "sh", *piped.argv]
    with piped:
        piped.wait_up()
        wait_until(
            lambda: not any(c.startswith("sed ") for c in commands(piped).values()), 10, "no reader"
        )
        [up_pid] = [
            pid
            for pid, cmd in commands(piped).items()
            if "prefix_router up" in cmd and not cmd.startswith("sh ")
        ]
        os.kill(up_pid, signal.SIGINT)
        piped.wait(timeout=60)  # the pipeline's status is the reader's
        assert piped.leftovers() == []


def commands(up: UpProcess) -> dict[int, str]:
    """The command lines of up's tree now."""
    found = {}
    for pid in up.track():
        with contextlib.suppress(psutil.NoSuchProcess):
            found[pid] = " ".join(psutil.Process(pid).cmdline())
    return found


def test_up_in_front_of_servers_run_with_an_api_key(
    namespace: str, procs: ProcessReaper, tmp_path: Path
) -> None:
    """vLLM started with ``--api-key`` and the same key exported as VLLM_API_KEY (the
    README's set-up): up learns the model and checks the route with the key, where it used
    to ask without it and give up after a minute; clients still need their own key."""
    port = free_port()
    sim = ["--ports", str(port), "--api-key", "sk-test", "--model", "served-model"]
    procs.add(start_module("sim", "vllm_sim", sim, tmp_path, ready_ports=[port]))
    ports = {name: free_port() for name in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    args = ["--run-dir", str(tmp_path / "run"), "--ext-procs", "1", "--namespace", namespace]
    args += ["--backend", f"http://127.0.0.1:{port}"]
    for name, value in ports.items():
        args += [f"--{name}", str(value)]
    with UpProcess(args, tmp_path / "up.out", env={**os.environ, "VLLM_API_KEY": "sk-test"}) as up:
        banner = up.wait_up(timeout=60)
        assert '"model": "served-model"' in banner
        body = {
            "model": "served-model",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}],
        }
        url = f"http://127.0.0.1:{ports['port']}/v1/chat/completions"
        with httpx.Client(timeout=10) as client:
            assert client.post(url, json=body).status_code == 401
            keyed = client.post(url, json=body, headers={"authorization": "Bearer sk-test"})
            assert keyed.status_code == 200
        assert up.terminate() == 0


def test_up_on_another_address_serves_there_and_keeps_its_inner_parts_on_loopback(
    namespace: str, tmp_path: Path
) -> None:
    """``--host`` is where users reach Envoy and the admin API (127.0.0.2 here, one of
    this machine's addresses): up starts on it (it used to look for its parts on
    127.0.0.1 and give up), and Envoy's unauthenticated admin is not served there."""
    host = "127.0.0.2"
    ports = {name: free_port() for name in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    args = ["--run-dir", str(tmp_path / "run"), "--instances", "1", "--ext-procs", "1"]
    args += ["--host", host, "--namespace", namespace]
    for name, value in ports.items():
        args += [f"--{name}", str(value)]
    with UpProcess(args, tmp_path / "up.out") as up:
        up.wait_up(timeout=90)
        with httpx.Client(timeout=10) as client:
            body = {"model": "meta-llama/Llama-3.1-70B-Instruct", "max_tokens": 2}
            body["messages"] = [{"role": "user", "content": "hi"}]  # type: ignore[assignment]
            url = f"http://{host}:{ports['port']}/v1/chat/completions"
            assert client.post(url, json=body).status_code == 200
            assert client.get(f"http://{host}:{ports['admin-port']}/healthz").status_code == 200
            admin = f":{ports['envoy-admin-port']}/server_info"
            assert client.get(f"http://127.0.0.1{admin}").status_code == 200
            with pytest.raises(httpx.ConnectError):
                client.get(f"http://{host}{admin}")
        assert up.terminate() == 0
