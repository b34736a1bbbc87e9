"""``prefix-router up``: the whole router on one machine, with one command.

Starts, in order, and stops in reverse order on Ctrl-C or SIGTERM:

1. Redis: ``--redis-url``/``REDIS_URL`` if given; else a ``redis-server`` from
   PATH on a free port; else none (a static fleet, counts kept per process,
   with a warning).
2. The simulated vLLM instances (unless real backends are given).
3. The control plane (xDS + admin API), seeded with the fleet and config.
4. N ext_proc workers, following the control plane's state in Redis.
5. Envoy, from ``envoy/bootstrap.yaml``, fed by the control plane over ADS.

It is ready only when a real chat completion through Envoy succeeds; then it
prints where to send requests, and supervises: a process that exits is
restarted on the same ports with backoff (:mod:`prefix_router.ops.supervise`),
the exit is printed with its status and the end of its log, and the report
goes to the control plane's status page and metrics through Redis
(:mod:`prefix_router.ops.report`). Only Ctrl-C or SIGTERM stops the stack.

Settings come from flags, then ``PREFIX_ROUTER_*`` environment variables, then
an optional YAML file (``--settings``), then defaults, and are validated before
anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefix_router.core.config import RouterConfig, describe_validation_error, parse_config
from prefix_router.core.errors import ConfigError, FleetError, StartupError
from prefix_router.core.fleet import (
    FLEET_FILE_FIELDS,
    INSTANCE_API_KEY_ENV,
    Fleet,
    Instance,
    fleet_from_file,
    fleet_from_urls,
)
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import (
    delete_namespace,
    envoy_command,
    envoy_live,
    start_envoy,
    start_ext_proc,
    start_module,
    start_redis_server,
    wait_routable,
)
from prefix_router.ops.procs import (
    ManagedProcess,
    cli_command,
    free_port,
    port_answers,
    port_is_free,
    reserve_ports,
    wait_until_listening,
)
from prefix_router.ops.report import ReportPublisher
from prefix_router.ops.supervise import Backoff, Component, Event, Supervisor
from prefix_router.state.redis_url import redacted

ENV_PREFIX = "PREFIX_ROUTER_"
LOOPBACK = "127.0.0.1"
"""Where the stack's inner parts listen whatever ``--host`` is: Redis, the simulators,
ext_proc, the xDS port and Envoy's admin (unauthenticated: ``/quitquitquit``) serve only
the stack itself. ``--host`` is for what users reach: Envoy's listener and the admin API."""


class UpSettings(BaseModel):
    """Settings of ``prefix-router up``; each is a flag, an env var and a YAML key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(
        "127.0.0.1",
        description="address Envoy's listener and the admin API bind (the stack's other "
        "parts listen on 127.0.0.1 only)",
    )
    port: int = Field(8080, ge=1, le=65535, description="OpenAI-compatible data plane (Envoy)")
    admin_port: int = Field(8081, ge=1, le=65535, description="admin REST API")
    envoy_admin_port: int = Field(9901, ge=1, le=65535, description="Envoy admin and stats")
    xds_port: int = Field(18000, ge=1, le=65535, description="control plane xDS (gRPC)")
    http_max_connections: int | None = Field(
        None,
        ge=1,
        description="connections the admin port holds at once (default: the control "
        "plane's, 64); past it one waiting for a request head is evicted",
    )
    ext_procs: int = Field(2, ge=1, le=32, description="ext_proc worker processes")
    envoy_concurrency: int = Field(2, ge=1, le=64, description="Envoy worker threads")
    instances: int = Field(4, ge=1, le=64, description="simulated vLLM instances")
    sim_profile: str = Field("llama-3.1-70b-8xh100", description="simulator profile")
    sim_time_scale: float = Field(1.0, gt=0, description="simulator speed-up")
    sim_serve: list[str] = Field(
        default_factory=list,
        description="what one simulated instance serves: MODEL[,ADAPTER...], cycled over the "
        "instances; the control plane then discovers the pools",
    )
    backend: list[str] = Field(default_factory=list, description="real backend URLs")
    clock_scale: float | None = Field(
        None,
        gt=0,
        description="the instances' seconds per wall second: default --sim-time-scale for "
        "simulated instances, 1 with --backend (set it for simulators run at a time scale)",
    )
    fleet: str | None = Field(None, description="fleet YAML (instances and routing)")
    config: str | None = Field(None, description="routing config YAML")
    redis_url: str | None = Field(None, description="Redis to share state and counts")
    namespace: str = Field("prefix-router-local:", description="Redis key prefix; cleared at start")
    admin_token: str | None = Field(None, description="admin API bearer token")
    run_dir: str = Field("run", description="logs, rendered configs, the lock")
    exit_with_parent: bool = Field(
        False,
        description="stop everything when the process that started up exits (make run sets "
        "it: a SIGTERM to make alone would leave the stack running)",
    )

    @property
    def instance_clock_scale(self) -> float:
        """What the router's clocks run at: its modelled queues drain as its instances work."""
        if self.clock_scale is not None:
            return self.clock_scale
        return 1.0 if self.backend else self.sim_time_scale

    @field_validator("host")
    @classmethod
    def _ipv4(cls, host: str) -> str:
        """Every listener binds it and every process reaches the others there: an IPv4
        address (a name would reach Envoy as "malformed IP address")."""
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(
                f"{host!r} is not an IPv4 address (127.0.0.1, 0.0.0.0, or one of this "
                "machine's); up does not listen on IPv6"
            ) from None
        return host

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if url is not None and url.partition("://")[0] not in ("redis", "rediss", "unix"):
            raise ValueError(f"{url!r} is not a redis://, rediss:// or unix:// URL")
        return url

    @model_validator(mode="after")
    def _distinct_ports(self) -> UpSettings:
        ports = [self.port, self.admin_port, self.envoy_admin_port, self.xds_port]
        if len(set(ports)) != len(ports):
            raise ValueError(f"port, admin_port, envoy_admin_port, xds_port must differ: {ports}")
        return self


_LISTS = {"backend": ";", "sim_serve": ";"}
"""Repeatable settings -> the separator of their env var's items."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefix-router up",
        description="Run the whole router locally: Redis, simulated vLLM, control plane, "
        "ext_proc and Envoy. Ctrl-C stops everything.",
    )
    p.add_argument("--settings", help="YAML file of settings (lowest precedence but defaults)")
    for name, field in UpSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        help_ = f"{field.description} (env {env})"
        if name in _LISTS:
            p.add_argument(flag, action="append", help=help_ + "; repeatable")
        else:
            p.add_argument(flag, help=help_)
    for name, (_, help_) in ROUTING_SHORTCUTS.items():
        p.add_argument(
            "--" + name.replace("_", "-"), help=f"{help_} (env {ENV_PREFIX}{name.upper()})"
        )
    return p


ROUTING_SHORTCUTS: dict[str, tuple[tuple[str, ...], str]] = {
    "prefix_length": (("prefix_length",), "PrefixLength: bytes of the prompt keyed on"),
    "prefix_mode": (("prefix_mode",), "prefix key mode: openai or bytes"),
    "tenant_header": (("tenant_header",), "header that scopes keys per tenant"),
    "concurrency_threshold": (
        ("concurrency_threshold",),
        "ConcurrencyThreshold: requests waiting for a first token that overload an "
        "instance (off: no threshold)",
    ),
    "spill_policy": (("spill", "policy"), "least-work or none"),
}
"""The routing settings that ``up`` also takes as flags and env vars (over the config file)."""


def resolve_settings(
    argv: Sequence[str], environ: dict[str, str] | None = None
) -> tuple[UpSettings, RouterConfig]:
    """Flags > env vars > settings file > defaults; validated, with one message per problem."""
    environ = dict(os.environ if environ is None else environ)
    args = vars(_parser().parse_args(list(argv)))
    merged: dict[str, Any] = {}
    settings_file = args.pop("settings") or environ.get(ENV_PREFIX + "SETTINGS")
    if settings_file:
        merged.update(_read_yaml(settings_file))
    for name in UpSettings.model_fields:
        env_value = environ.get(ENV_PREFIX + name.upper())
        if name == "redis_url" and env_value is None:
            env_value = environ.get("REDIS_URL")
        if env_value is not None:
            merged[name] = env_value.split(_LISTS[name]) if name in _LISTS else env_value
        if args.get(name) is not None:
            merged[name] = args[name]
    try:
        settings = UpSettings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    routing: dict[str, Any] = {}
    if settings.fleet:
        routing.update(_read_yaml(settings.fleet).get("routing") or {})
    if settings.config:
        config_data = _read_yaml(settings.config)
        routing.update(config_data.get("routing", config_data))
    for name, (path, _) in ROUTING_SHORTCUTS.items():
        value = args.get(name) or environ.get(ENV_PREFIX + name.upper())
        if value is not None:
            target = routing
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = value
    return settings, parse_config(routing)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """One ``up`` per run folder: a second one fails at once with the first one's PID."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "up.lock"
    handle = open(path, "a+")  # noqa: SIM115 - held for the lifetime of the stack
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise StartupError(f"already running (pid {owner}, lock {path}); stop it first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    try:
        yield
    finally:
        handle.close()
        with contextlib.suppress(OSError):
            path.unlink()


class Stack:
    """The processes of one ``up``, started in order and stopped in reverse order."""

    def __init__(self, settings: UpSettings, config: RouterConfig) -> None:
        self.settings = settings
        self.config = config
        self.run_dir = Path(settings.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.components: list[Component] = []
        self.redis_url: str | None = settings.redis_url
        self.own_redis = False
        self.token = settings.admin_token or secrets.token_urlsafe(24)
        self.fleet: Fleet | None = None
        self._cleared = False
        self.ext_proc_metrics: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------

    def check_ports(self) -> None:
        s = self.settings
        for name, port in (
            ("--port", s.port),
            ("--admin-port", s.admin_port),
            ("--envoy-admin-port", s.envoy_admin_port),
            ("--xds-port", s.xds_port),
        ):
            host = s.host if name in ("--port", "--admin-port") else LOOPBACK
            if not port_is_free(port, host):
                raise StartupError(f"port {port} ({name}) is taken: free it or choose another")
        reserve_ports([s.port, s.admin_port, s.envoy_admin_port, s.xds_port])

    def start(self) -> None:
        self.check_ports()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start_redis()
        self.fleet = self._start_backends()
        if self.redis_url is None:
            self._start_static()
        else:
            self._start_dynamic()
        self.wait_ready()

    @property
    def procs(self) -> list[ManagedProcess]:
        """The current process of each component, in start order."""
        return [c.proc for c in self.components]

    def supervisor(self, **kwargs: Any) -> Supervisor:
        """A supervisor of every component started (``Supervisor`` keyword arguments)."""
        return Supervisor(self.components, **kwargs)

    def stop(self) -> None:
        for component in reversed(self.components):
            component.proc.stop(grace=5.0)
        self.components.clear()
        if self.settings.redis_url is not None and self._cleared:
            with contextlib.suppress(StartupError):
                self._clear_namespace()  # an external Redis keeps nothing of a local stack

    def _add(
        self,
        proc: ManagedProcess,
        *,
        ready: Callable[[], bool],
        spawn: Callable[[], ManagedProcess] | None = None,
    ) -> ManagedProcess:
        """Register a started process; ``spawn`` restarts it (default: the same command),
        ``ready`` says that a restarted one serves."""
        self.components.append(
            Component(proc.name, proc, spawn or (lambda: proc.clone().start()), ready)
        )
        return proc

    def _answers(self, *ports: int, host: str = LOOPBACK) -> Callable[[], bool]:
        return lambda: all(port_answers(p, host) for p in ports)

    # -- components ----------------------------------------------------------------------

    def _start_redis(self) -> None:
        if self.redis_url is not None:
            return
        binary = shutil.which("redis-server")
        if binary is None:
            say(
                "warning: no REDIS_URL and no redis-server on PATH: running a static fleet "
                "with one ext_proc; in-flight counts are not shared and the admin API "
                "cannot change the fleet"
            )
            return
        port = free_port(LOOPBACK)
        self._add(
            start_redis_server(binary, port, self.log_dir, host=LOOPBACK),
            ready=self._answers(port),
        )
        self.redis_url = f"redis://{LOOPBACK}:{port}/0"
        self.own_redis = True

    def _start_backends(self) -> Fleet:
        s = self.settings
        if s.backend:
            return fleet_from_urls(list(s.backend))
        if s.fleet:
            try:
                return fleet_from_file(_read_yaml(s.fleet).get("instances") or [])
            except FleetError as exc:
                raise ConfigError(f"fleet file {s.fleet}: {exc}") from None
        ports = [free_port(LOOPBACK) for _ in range(s.instances)]
        args = [
            "--ports",
            ",".join(map(str, ports)),
            "--host",
            LOOPBACK,
            "--profile",
            s.sim_profile,
            "--time-scale",
            str(s.sim_time_scale),
            *(arg for spec in s.sim_serve for arg in ("--serve", spec)),
        ]
        self._add(
            start_module("vllm-sim", "vllm_sim", args, self.log_dir, ready_ports=ports),
            ready=self._answers(*ports),
        )
        return Fleet.of([Instance(LOOPBACK, p) for p in ports])

    def _write_fleet_file(self) -> Path:
        assert self.fleet is not None
        path = self.run_dir / "fleet.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "instances": [
                        {k: v for k, v in i.to_json_dict().items() if k in FLEET_FILE_FIELDS}
                        for i in self.fleet.instances
                    ],
                    "routing": self.config.to_json_dict(),
                },
                sort_keys=False,
            )
        )
        return path

    def _clear_namespace(self) -> None:
        """A local stack starts from its fleet file, not from a previous run's state."""
        import redis

        assert self.redis_url is not None
        try:
            delete_namespace(self.redis_url, self.settings.namespace)
            self._cleared = True
        except redis.RedisError as exc:
            raise StartupError(
                f"Redis at {redacted(self.redis_url)} does not answer: {exc}"
            ) from None

    def control_plane_args(self, fleet_file: Path) -> list[str]:
        """The control plane's flags: where it listens and what it serves, from the
        settings (a limit left unset keeps the control plane's own default)."""
        s = self.settings
        assert self.redis_url is not None
        cap = s.http_max_connections
        limits = [] if cap is None else ["--http-max-connections", str(cap)]
        return [
            *("--xds-host", LOOPBACK, "--xds-port", str(s.xds_port)),
            *("--admin-host", s.host, "--admin-port", str(s.admin_port)),
            *limits,
            *("--redis-url", self.redis_url, "--namespace", s.namespace),
            *("--fleet", str(fleet_file)),
            # real backends, or simulators serving several models: learn the pools
            *(["--discover-models"] if s.backend or s.sim_serve else []),
            *("--clock-scale", f"{s.instance_clock_scale:g}"),
        ]

    def _start_dynamic(self) -> None:
        s = self.settings
        assert self.redis_url is not None
        self._clear_namespace()
        fleet_file = self._write_fleet_file()
        env = {"PREFIX_ROUTER_ADMIN_TOKEN": self.token}
        control_plane = ManagedProcess(
            "control-plane",
            cli_command("control-plane", *self.control_plane_args(fleet_file)),
            self.log_dir / "control-plane.log",
            env=env,
        ).start()
        admin = self._answers(s.admin_port, host=s.host)
        xds = self._answers(s.xds_port)
        self._add(control_plane, ready=lambda: admin() and xds())
        wait_until_listening(control_plane, s.admin_port, host=s.host)
        wait_until_listening(control_plane, s.xds_port, host=LOOPBACK)
        ext_proc_ports = [free_port(LOOPBACK) for _ in range(s.ext_procs)]
        for i, port in enumerate(ext_proc_ports):
            metrics_port = free_port(LOOPBACK)
            self.ext_proc_metrics.append(f"http://{LOOPBACK}:{metrics_port}/metrics")
            self._add(
                start_ext_proc(
                    port,
                    self.log_dir,
                    name=f"ext_proc-{i}",
                    args=[
                        "--host",
                        LOOPBACK,
                        "--redis-url",
                        self.redis_url,
                        "--namespace",
                        s.namespace,
                        "--metrics-port",
                        str(metrics_port),
                        "--clock-scale",
                        f"{s.instance_clock_scale:g}",
                    ],
                ),
                ready=self._answers(port),
            )
        self._start_envoy(ext_proc_ports, xds=(LOOPBACK, s.xds_port))

    def _start_static(self) -> None:
        s = self.settings
        assert self.fleet is not None
        port = free_port(LOOPBACK)
        config_file = self.run_dir / "routing.json"
        config_file.write_text(json.dumps(self.config.to_json_dict()))
        args = ["--host", LOOPBACK, "--config", str(config_file)]
        args += ["--clock-scale", f"{s.instance_clock_scale:g}"]
        for inst in self.fleet.instances:
            args += ["--backend", inst.to_url()]
        self._add(
            start_ext_proc(port, self.log_dir, name="ext_proc-0", args=args),
            ready=self._answers(port),
        )
        self._start_envoy([port], xds=None)

    def _start_envoy(self, ext_proc_ports: list[int], xds: tuple[str, int] | None) -> None:
        s = self.settings
        params = BootstrapParams(
            listen_address=s.host,
            listen_port=s.port,
            admin_address=LOOPBACK,  # unauthenticated (/quitquitquit): never on --host
            admin_port=s.envoy_admin_port,
            ext_proc=tuple((LOOPBACK, p) for p in ext_proc_ports),
            xds=xds,
        )
        envoy = start_envoy(
            params, self.config, self.log_dir, fleet=self.fleet, concurrency=s.envoy_concurrency
        )
        command = envoy_command(self.log_dir, concurrency=s.envoy_concurrency)
        base_id = command.base_id()

        def respawn() -> ManagedProcess:
            """Same bootstrap (ports), same base id; see EnvoyCommand."""
            return ManagedProcess(envoy.name, command.argv(base_id), envoy.log_path).start()

        def serves() -> bool:
            return envoy_live(s.envoy_admin_port, LOOPBACK, timeout=0.5) and port_answers(
                s.port, s.host
            )

        self._add(envoy, ready=serves, spawn=respawn)

    # -- readiness -----------------------------------------------------------------------

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Ready when a real chat completion through Envoy answers 200."""
        s = self.settings
        wait_routable(
            f"http://{s.host}:{s.port}",
            self._model_name(),
            self.procs,
            timeout,
            api_key=os.environ.get(INSTANCE_API_KEY_ENV),
        )

    def _model_name(self) -> str:
        """The model the first instance serves (asked with the instances' API key, for
        servers started with ``--api-key``), else the simulator's profile name."""
        s = self.settings
        url = f"http://{self.fleet.instances[0].id}/v1/models" if self.fleet else ""
        key = os.environ.get(INSTANCE_API_KEY_ENV)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            request = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(request, timeout=5) as r:
                return str(json.load(r)["data"][0]["id"])
        return s.sim_profile

    def banner(self) -> str:
        s = self.settings
        base = f"http://{s.host}:{s.port}"
        lines = [
            "prefix-router is up.",
            f"  OpenAI base URL   {base}/v1",
            f"  try               curl {base}/v1/chat/completions -H 'content-type: "
            f'application/json\' -d \'{{"model": "{self._model_name()}", "messages": '
            f'[{{"role": "user", "content": "Hello"}}]}}\'',
        ]
        if self.redis_url is not None:
            lines += [
                f"  admin API         http://{s.host}:{s.admin_port}  (every route needs "
                "'Authorization: Bearer <admin token>'; its OpenAPI document: /openapi.json)",
                f"  admin token       {self.token}",
                f"  status page       http://{s.host}:{s.admin_port}/ui",
                f"  metrics           http://{s.host}:{s.admin_port}/metrics (control plane, "
                "fleet view)",
                *(f"                    {url} (ext_proc)" for url in self.ext_proc_metrics),
            ]
        if self.own_redis:
            lines.append(f"  Redis             {self.redis_url}  (this stack's own)")
        members = ", ".join(i.id for i in self.fleet.instances) if self.fleet else "-"
        lines += [
            f"  Envoy admin       http://{LOOPBACK}:{s.envoy_admin_port}  (stats at /stats)",
            f"  instances         {members}",
            f"  logs              {self.log_dir}",
            "Ctrl-C stops everything.",
        ]
        return "\n".join(lines)


def supervise(
    stack: Stack,
    stop: threading.Event,
    *,
    poll_s: float = 0.1,
    backoff: Backoff | None = None,
    on_event: Callable[[Event], None] | None = None,
) -> None:
    """Restart whatever exits until ``stop`` is set; print each event (and hand it to
    ``on_event``) and keep the control plane's report (through Redis) current."""

    def print_event(event: Event) -> None:
        say(event.message())
        if on_event is not None:
            on_event(event)

    supervisor = stack.supervisor(backoff=backoff or Backoff(), on_event=print_event)
    publisher = (
        ReportPublisher(stack.redis_url, stack.settings.namespace)
        if stack.redis_url is not None
        else None
    )
    try:
        while not stop.is_set():
            events = supervisor.poll()
            if publisher is not None:
                publisher.publish(supervisor.report, now=bool(events))
            stop.wait(poll_s)
    finally:
        if publisher is not None:
            publisher.close()


def stop_when_orphaned(parent: int, stop: threading.Event, poll_s: float = 0.5) -> None:
    """Set ``stop`` once this process's parent is no longer ``parent`` (it exited and the
    process was handed to another): what ``--exit-with-parent`` watches."""
    while not stop.wait(poll_s):
        if os.getppid() != parent:
            say(f"parent {parent} exited: stopping")
            stop.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the main thread may be starting the stack


def say(message: str, stream: TextIO | None = None) -> None:
    """Print a line for the operator (to stderr by default), if anyone can still read it.

    A closed terminal (EIO), or a pipe whose reader is gone (``up 2>&1 | tee``, and
    Ctrl-C stops ``tee`` too: EPIPE), must not stop the stack from stopping its
    processes, nor the supervisor from restarting them."""
    try:
        print(message, file=stream or sys.stderr, flush=True)
    except (OSError, ValueError):  # ValueError: the stream was closed
        pass


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Each stops the stack and every process in it: SIGHUP is a closed terminal or a dropped
ssh session, and the children, each in a session of its own, would not get it."""


class Interrupted(Exception):
    """A stop signal arrived while the stack was starting."""


def main(argv: Sequence[str] | None = None) -> int:
    settings, config = resolve_settings(list(argv or []))
    stop = threading.Event()
    starting = True

    def on_signal(signum: int, _frame: object) -> None:
        # Start-up waits up to a minute for the fleet: the first signal leaves it at once.
        # Only the first: a second one (Ctrl-C pressed twice) would land in the clean-up
        # the first started, and cut short the stop of a process not yet in the stack.
        if starting and not stop.is_set():
            stop.set()
            raise Interrupted(signal.Signals(signum).name)
        stop.set()

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    if settings.exit_with_parent:
        threading.Thread(
            target=stop_when_orphaned, args=(os.getppid(), stop), name="parent-watch", daemon=True
        ).start()
    with run_lock(Path(settings.run_dir)):
        stack = Stack(settings, config)
        try:
            stack.start()
            starting = False
            if not stop.is_set():
                say(stack.banner(), sys.stdout)
            supervise(stack, stop)
        except Interrupted as signal_name:
            say(f"{signal_name} during start-up")
        finally:
            starting = False
            if stack.procs:
                say("stopping...")
            stack.stop()
    return 0


__all__ = ["Stack", "UpSettings", "main", "port_answers", "resolve_settings", "supervise"]
