"""``prefix-router up``: settings precedence, one-line errors, and a clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from prefix_router.core.errors import ConfigError
from prefix_router.ops.procs import free_port
from prefix_router.ops.up import resolve_settings
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.e2e


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    settings_file = tmp_path / "up.yaml"
    settings_file.write_text("port: 7001\nadmin_port: 7002\next_procs: 3\n")
    env = {"PREFIX_ROUTER_PORT": "7101", "PREFIX_ROUTER_EXT_PROCS": "4"}
    settings, _ = resolve_settings(["--settings", str(settings_file), "--port", "7201"], env)
    assert (settings.port, settings.ext_procs, settings.admin_port) == (7201, 4, 7002)


def test_invalid_settings_are_one_clear_message(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ext_procs"):
        resolve_settings(["--ext-procs", "0"], {})
    with pytest.raises(ConfigError, match="must differ"):
        resolve_settings(["--port", "9000", "--admin-port", "9000"], {})
    bad = tmp_path / "routing.yaml"
    bad.write_text("routing:\n  prefix_length: 0\n")
    with pytest.raises(ConfigError, match="prefix_length"):
        resolve_settings(["--config", str(bad)], {})


def descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def test_up_serves_then_sigterm_leaves_no_process_behind(tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("port", "admin-port", "envoy-admin-port", "xds-port")}
    argv = [
        sys.executable,
        "-m",
        "prefix_router",
        "up",
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
        f"test-up-{uuid.uuid4().hex[:8]}:",
    ]
    for name, port in ports.items():
        argv += [f"--{name}", str(port)]
    out = tmp_path / "up.out"
    with out.open("wb") as sink:
        up = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while "prefix-router is up" not in out.read_text() and time.monotonic() < deadline:
            assert up.poll() is None, out.read_text()
            time.sleep(0.2)
        assert "prefix-router is up" in out.read_text(), out.read_text()
        assert "admin token" in out.read_text()
        children = descendants(up.pid)
        assert len(children) >= 4  # sim, control plane, ext_proc, envoy
        body = json.dumps(
            {
                "model": "meta-llama/Llama-3.1-70B-Instruct",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports['port']}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.status == 200
        run_readme_examples(out.read_text(), ports["port"], ports["admin-port"])
        second = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert second.returncode == 2
        assert "already running" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        leftovers = {
            pid
            for pid in children
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        }
        assert leftovers == set()
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        for pid in children:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_taken_port_is_a_one_line_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefix_router",
                "up",
                "--run-dir",
                str(tmp_path / "run"),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
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
    answer = subprocess.run(
        ["bash", "-c", localise(first_request)], capture_output=True, text=True, timeout=30
    )
    assert answer.returncode == 0 and '"choices"' in answer.stdout, answer
    client = readme_blocks("python")[0]
    printed = subprocess.run(
        [sys.executable, "-c", localise(client)], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0 and printed.stdout.strip(), printed
    admin = next(b for b in readme_blocks("sh") if "/status" in b)
    for command in admin.replace("\\\n", " ").strip().splitlines():
        done = subprocess.run(
            ["bash", "-c", localise(command) + " --fail-with-body -sS"],
            capture_output=True, text=True, timeout=30, env=env,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stdout, done.stderr)
