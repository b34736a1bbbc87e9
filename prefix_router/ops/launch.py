"""Start one component as a child process and wait until it serves.

``prefix-router up`` and the end-to-end tests start components the same way,
through these functions, so what the tests run is what users run.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefix_router.core.config import RouterConfig
from prefix_router.core.errors import StartupError
from prefix_router.core.fleet import Fleet
from prefix_router.envoy.bootstrap import BootstrapParams, render_bootstrap
from prefix_router.ops.procs import (
    ManagedProcess,
    cli_command,
    envoy_binary,
    python_module_command,
    wait_until_listening,
)
from prefix_router.state.store import glob_escape


@dataclass(frozen=True, slots=True)
class EnvoyCommand:
    """How ``up`` runs Envoy: its bootstrap, worker threads and base id.

    The first start lets Envoy pick a free base id (``--use-dynamic-base-id``) and
    write it to ``base_id_path``; a restart passes that id again, so the new Envoy
    is the same one to the machine (hot restart is not used: the restart epoch
    stays 0, and Envoy then clears the shared memory a killed one left behind,
    where a new id each time would leave one segment in /dev/shm per crash).
    """

    bootstrap: Path
    base_id_path: Path
    concurrency: int = 2

    def argv(self, base_id: int | None = None) -> list[str]:
        ident = ["--use-dynamic-base-id"] if base_id is None else ["--base-id", str(base_id)]
        return [
            envoy_binary(),
            "-c",
            str(self.bootstrap),
            "--concurrency",
            str(self.concurrency),
            "--log-level",
            "warning",
            "--base-id-path",
            str(self.base_id_path),
            *ident,
            "--drain-time-s",
            "1",
            "--parent-shutdown-time-s",
            "2",
        ]

    def base_id(self) -> int | None:
        """The base id the running (or last) Envoy wrote; ``None`` if there is none."""
        try:
            return int(self.base_id_path.read_text().strip())
        except (OSError, ValueError):
            return None


def envoy_command(log_dir: Path, *, name: str = "envoy", concurrency: int = 2) -> EnvoyCommand:
    return EnvoyCommand(log_dir / f"{name}.yaml", log_dir / f"{name}.base-id", concurrency)


def start_envoy(
    params: BootstrapParams,
    config: RouterConfig,
    log_dir: Path,
    *,
    fleet: Fleet | None = None,
    concurrency: int = 2,
    name: str = "envoy",
    under: Sequence[str] = (),
) -> ManagedProcess:
    """Render the bootstrap into ``log_dir`` and start Envoy, as an argument of ``under``
    if given (``prefix-router envoy-run --``); ready when its admin says LIVE."""
    command = envoy_command(log_dir, name=name, concurrency=concurrency)
    log_dir.mkdir(parents=True, exist_ok=True)
    command.bootstrap.write_text(render_bootstrap(params, config, fleet))
    argv = [*under, *command.argv()]
    proc = ManagedProcess(name, argv, log_dir / f"{name}.log").start()
    try:
        wait_until_listening(proc, params.admin_port)
        wait_envoy_live(proc, params.admin_port)
    except BaseException:
        proc.stop()
        raise
    return proc


def envoy_live(admin_port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    """One look at Envoy's admin: initialised and serving (``LIVE``)."""
    try:
        with urllib.request.urlopen(
            f"http://{host}:{admin_port}/server_info", timeout=timeout
        ) as r:
            return bool(json.load(r).get("state") == "LIVE")
    except (OSError, ValueError):
        return False


def wait_envoy_live(proc: ManagedProcess, admin_port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if envoy_live(admin_port):
            return
        if not proc.alive():
            raise StartupError(f"envoy exited during start-up:\n{proc.tail()}")
        time.sleep(0.05)
    raise StartupError(f"envoy not LIVE after {timeout}s:\n{proc.tail()}")


def start_ext_proc(
    port: int,
    log_dir: Path,
    *,
    args: Sequence[str] = (),
    name: str | None = None,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """``prefix-router ext-proc --port PORT ARGS...``; ready when its port accepts."""
    name = name or f"ext_proc-{port}"
    proc = ManagedProcess(
        name,
        cli_command("ext-proc", "--port", str(port), *args),
        log_dir / f"{name}.log",
        env=env,
    ).start()
    try:
        wait_until_listening(proc, port)
    except BaseException:
        proc.stop()
        raise
    return proc


def start_module(
    name: str,
    module: str,
    args: Sequence[str],
    log_dir: Path,
    *,
    ready_ports: Sequence[int],
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> ManagedProcess:
    """``python -m MODULE ARGS...``; ready when every port in ``ready_ports`` accepts."""
    proc = ManagedProcess(
        name, python_module_command(module, *args), log_dir / f"{name}.log", env=env
    ).start()
    try:
        for port in ready_ports:
            wait_until_listening(proc, port, timeout=timeout)
    except BaseException:
        proc.stop()
        raise
    return proc


def start_redis_server(
    binary: str, port: int, log_dir: Path, *, host: str = "127.0.0.1", name: str = "redis"
) -> ManagedProcess:
    """A throw-away ``redis-server`` (nothing saved to disk); ready when its port accepts."""
    proc = ManagedProcess(
        name,
        [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"],
        log_dir / f"{name}.log",
    ).start()
    try:
        wait_until_listening(proc, port, host=host)
    except BaseException:
        proc.stop()
        raise
    return proc


def wait_routable(
    base_url: str,
    model: str,
    procs: Sequence[ManagedProcess],
    timeout_s: float = 60.0,
    *,
    api_key: str | None = None,
) -> None:
    """Ready when a chat completion through ``base_url`` answers 200 (sent with
    ``api_key`` as a bearer token when the instances need one)."""
    body = json.dumps(
        {
            "model": model,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "prefix-router readiness check"}],
        }
    ).encode()
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        for proc in procs:
            if not proc.alive():
                raise StartupError(f"{proc.name} exited during start-up:\n{proc.tail()}")
        request = urllib.request.Request(
            f"{base_url}/v1/chat/completions",
            data=body,
            headers={
                "content-type": "application/json",
                **({"authorization": f"Bearer {api_key}"} if api_key else {}),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise StartupError(f"nothing routable through {base_url} in {timeout_s:.0f}s ({last})")


def delete_namespace(redis_url: str, namespace: str, *, timeout_s: float = 5.0) -> int:
    """Delete every key under ``namespace`` in the Redis at ``redis_url``; how many.

    What ``up`` does before a local stack starts from its fleet file, and what a test or
    benchmark does after its processes stop, so the next run finds none of its state.
    Raises ``redis.RedisError`` when Redis does not answer within ``timeout_s``.
    """
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s)
    try:
        keys = list(client.scan_iter(match=glob_escape(namespace) + "*"))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()
