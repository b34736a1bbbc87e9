"""The ``prefix-router`` command: one entry point, one subcommand per component.

Each subcommand lives in its own module and is imported only when used, so
``prefix-router sim`` does not load gRPC and ``prefix-router ext-proc`` does
not load FastAPI.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from prefix_router import __version__
from prefix_router.core.errors import PrefixRouterError

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("prefix_router.ops.up", "run the whole router locally (Ctrl-C stops it)"),
    "ext-proc": ("ext_proc.server", "the Envoy External Processing server"),
    "control-plane": ("control_plane.server", "the xDS server and admin API"),
    "sim": ("vllm_sim.cli", "simulated vLLM instances (prefix cache + TTFT model)"),
    "bench": ("bench.cli", "benchmark routing policies through the real stack"),
    "envoy-bootstrap": ("prefix_router.ops.bootstrap_cli", "print an Envoy bootstrap"),
    "envoy-drain": ("prefix_router.ops.drain_cli", "let Envoy's open requests finish (preStop)"),
    "envoy-run": ("prefix_router.ops.envoy_run", "run Envoy, drained before it stops (compose)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"prefix-router {__version__}: prefix-aware routing for vLLM fleets", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "prefix-router COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"prefix-router: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        code: int = module.main(rest)
    except PrefixRouterError as exc:
        print(f"prefix-router {name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
