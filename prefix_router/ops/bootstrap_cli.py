"""``prefix-router envoy-bootstrap``: render Envoy's bootstrap from flags.

Containers run it just before Envoy, so one image serves every topology::

    prefix-router envoy-bootstrap --listen-address 0.0.0.0 \\
        --probe-address 0.0.0.0 --probe-port 9902 \\
        --ext-proc 127.0.0.1:50051 --xds control-plane:18000 --out /tmp/envoy.yaml \\
      && exec envoy -c /tmp/envoy.yaml

Addresses may be IP literals or DNS names (a compose service, a Kubernetes Service);
for a name Envoy's cluster is STRICT_DNS, so every replica behind it gets streams.
The fleet comes from the control plane (``--xds``) or, for a fixed fleet, from a
fleet file (``--fleet``, the control plane's format). Every flag can also be given
as an environment variable, ``PREFIX_ROUTER_BOOTSTRAP_`` + the flag's name in capitals
(``--ext-proc`` takes a comma-separated list there); flags win.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from prefix_router.core.config import RouterConfig, load_config_file
from prefix_router.core.errors import ConfigError, FleetError
from prefix_router.core.fleet import Fleet, fleet_from_file
from prefix_router.envoy.bootstrap import (
    BODY_BUFFER_SLACK,
    DEFAULT_EXT_PROC_TIMEOUT_MS,
    DEFAULT_MAX_BODY_BYTES,
    BootstrapParams,
    render_bootstrap,
)

ENV_PREFIX = "PREFIX_ROUTER_BOOTSTRAP_"


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> ``(host, port)``."""
    value = text.strip()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        ok = bool(sep)
    else:
        host, _, port_text = value.rpartition(":")
        ok = ":" not in host
    if not ok or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{text!r} is not host:port (port 1..65535)")
    return host, int(port_text)


def _env(environ: Mapping[str, str], flag: str) -> str | None:
    return environ.get(ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper())


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefix-router envoy-bootstrap",
        description="Print the Envoy bootstrap for prefix-router (or write it with --out). "
        f"Each flag falls back to the env var {ENV_PREFIX}<FLAG>.",
    )

    def add(flag: str, default: str | None, help_: str) -> None:
        env_name = ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
        value = _env(environ, flag)
        p.add_argument(
            flag,
            default=value if value is not None else default,
            help=f"{help_} (env {env_name}; default {default})",
        )

    add("--listen-address", "127.0.0.1", "data-plane listener address")
    add("--listen-port", "8080", "data-plane listener port")
    add(
        "--admin-address",
        "127.0.0.1",
        "Envoy admin address; it can stop Envoy, keep it on loopback (use --probe-port)",
    )
    add("--admin-port", "9901", "Envoy admin port")
    add(
        "--probe-address",
        "127.0.0.1",
        "probe listener address (0.0.0.0 in a container, for the kubelet and Prometheus)",
    )
    add(
        "--probe-port",
        None,
        "probe listener port: GET /ready and /stats/prometheus only, proxied to the admin",
    )
    p.add_argument(
        "--ext-proc",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help=f"an ext_proc server; repeatable (env {ENV_PREFIX}EXT_PROC, comma-separated)",
    )
    add("--xds", None, "control plane xDS HOST:PORT; the fleet then comes over ADS")
    add("--fleet", None, "fleet YAML (instances: [...]) for a fixed fleet without --xds")
    add("--node-id", "prefix-router-envoy", "Envoy node id the control plane sees")
    add("--config", None, "routing config YAML (its routing: section or the whole file)")
    add(
        "--body-buffer-bytes",
        None,
        "bytes of a request Envoy buffers for ext_proc; at least --max-body-bytes "
        f"(default: that + {BODY_BUFFER_SLACK // 1024} KiB)",
    )
    add("--max-body-bytes", str(DEFAULT_MAX_BODY_BYTES), "larger request bodies get 413")
    add("--ext-proc-timeout-ms", str(DEFAULT_EXT_PROC_TIMEOUT_MS), "ext_proc message timeout")
    add(
        "--max-downstream-connections",
        None,
        "client connections Envoy keeps open; more are closed at once (default: half the "
        "open-file limit where this runs)",
    )
    add(
        "--max-heap-bytes",
        None,
        "Envoy's heap limit (its container's memory limit less a margin): past 95%% of it "
        "new requests get 503 instead of the process an OOM kill",
    )
    add("--out", None, "write here (atomically) instead of stdout")
    return p


def _int(flag: str, value: str, *, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{flag}: {value!r} is not an integer") from None
    if not low <= number <= high:
        raise ConfigError(f"{flag}: {number} out of range {low}..{high}")
    return number


def _fleet_from_file(path: str) -> Fleet:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read fleet file {path}: {exc}") from None
    instances = data.get("instances") if isinstance(data, dict) else None
    if not isinstance(instances, list) or not instances:
        raise ConfigError(f"fleet file {path}: expected a non-empty 'instances' list")
    try:
        return fleet_from_file(instances)
    except FleetError as exc:
        raise ConfigError(f"fleet file {path}: {exc}") from None


def build(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[BootstrapParams, RouterConfig, Fleet | None, str | None]:
    """Flags (then env vars, then defaults) -> what :func:`render_bootstrap` needs, and --out."""
    env = os.environ if environ is None else environ
    args = _parser(env).parse_args(list(argv))
    ext_proc_specs: list[str] = args.ext_proc or [
        s for s in (_env(env, "--ext-proc") or "").split(",") if s.strip()
    ]
    if not ext_proc_specs:
        raise ConfigError("give at least one --ext-proc HOST:PORT")
    if (args.xds is None) == (args.fleet is None):
        raise ConfigError("give exactly one of --xds HOST:PORT (control plane) or --fleet FILE")
    max_body = _int("--max-body-bytes", args.max_body_bytes, low=1, high=2**31 - 1)
    body_buffer = (
        max_body + BODY_BUFFER_SLACK
        if args.body_buffer_bytes is None
        else _int("--body-buffer-bytes", args.body_buffer_bytes, low=1024, high=2**31 - 1)
    )
    if body_buffer < max_body:  # Envoy would answer 413 to bodies it should route
        raise ConfigError(
            f"--body-buffer-bytes ({body_buffer}) is below --max-body-bytes ({max_body}): "
            "bodies in between would get 413 instead of reaching an instance"
        )
    params = BootstrapParams(
        listen_address=args.listen_address,
        listen_port=_int("--listen-port", args.listen_port, low=1, high=65535),
        admin_address=args.admin_address,
        admin_port=_int("--admin-port", args.admin_port, low=1, high=65535),
        probe_address=args.probe_address,
        probe_port=None
        if args.probe_port is None
        else _int("--probe-port", args.probe_port, low=1, high=65535),
        ext_proc=tuple(parse_host_port(s) for s in ext_proc_specs),
        node_id=args.node_id,
        xds=parse_host_port(args.xds) if args.xds is not None else None,
        body_buffer_bytes=body_buffer,
        max_body_bytes=max_body,
        ext_proc_timeout_ms=_int(
            "--ext-proc-timeout-ms", args.ext_proc_timeout_ms, low=1, high=60_000
        ),
        max_heap_bytes=None
        if args.max_heap_bytes is None
        else _int("--max-heap-bytes", args.max_heap_bytes, low=64 * 1024 * 1024, high=2**48),
        max_downstream_connections=None
        if args.max_downstream_connections is None
        else _int(
            "--max-downstream-connections", args.max_downstream_connections, low=1, high=2**31
        ),
    )
    ports = [("--listen-port", params.listen_port), ("--admin-port", params.admin_port)]
    if params.probe_port is not None:
        ports.append(("--probe-port", params.probe_port))
    for i, (flag, port) in enumerate(ports):
        for other, other_port in ports[i + 1 :]:
            if port == other_port:
                raise ConfigError(f"{flag} and {other} must differ (both {port})")
    config = load_config_file(args.config) if args.config else RouterConfig()
    fleet = _fleet_from_file(args.fleet) if args.fleet else None
    return params, config, fleet, args.out


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    params, config, fleet, out = build(sys.argv[1:] if argv is None else argv)
    text = render_bootstrap(params, config, fleet)
    yaml.safe_load(text)  # the template and its JSON fragments still make one YAML document
    if out is None:
        sys.stdout.write(text)
    else:
        _write_atomically(Path(out), text)
    return 0


__all__ = ["ENV_PREFIX", "build", "main", "parse_host_port"]
