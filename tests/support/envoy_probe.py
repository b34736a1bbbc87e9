"""Envoy from the container bootstrap (`prefix-router bootstrap`), with its probe listener."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from prefix_router.ops.bootstrap_cli import build
from prefix_router.ops.launch import start_envoy
from prefix_router.ops.procs import ManagedProcess, free_port
from tests.conftest import ProcessReaper


@dataclass(frozen=True)
class ProbedEnvoy:
    process: ManagedProcess
    listen: int
    admin: int
    probe: int


def start_envoy_with_probe_listener(procs: ProcessReaper, log_dir: Path) -> ProbedEnvoy:
    """A real Envoy in front of a one-instance fleet (nothing listening behind it), with
    ext_proc unreachable, and its ports."""
    fleet = log_dir / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"instances": [{"address": "127.0.0.1", "port": 1}]}))
    listen, admin, probe = free_port(), free_port(), free_port()
    params, config, fleet_obj, _ = build(
        [
            "--listen-port",
            str(listen),
            "--admin-port",
            str(admin),
            "--probe-port",
            str(probe),
            "--ext-proc",
            "127.0.0.1:1",
            "--fleet",
            str(fleet),
        ],  # fmt: skip
        {},
    )
    process = procs.add(start_envoy(params, config, log_dir, fleet=fleet_obj))
    return ProbedEnvoy(process, listen, admin, probe)
