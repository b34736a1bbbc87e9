"""What deployment files may call: the real ``prefix-router`` subcommands and their flags.

Compose and Kubernetes tests (``test_deploy_compose.py``, ``test_deploy_k8s.py``) check
every container command against the ``--help`` output of the installed CLI (and of the
Envoy binary), through the helpers here, so a renamed flag breaks a test, not a deployment.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prefix_router.ops.cli import COMMANDS
from prefix_router.ops.procs import envoy_binary

ROOT = Path(__file__).resolve().parent.parent

_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)(?:[ =](<[^>]+>|[A-Z][A-Z0-9_:]*|\{[^}]*\}))?")


@functools.cache
def cli_help(command: str) -> str:
    """``prefix-router COMMAND --help``, run as a user would (a fresh interpreter)."""
    result = subprocess.run(
        [sys.executable, "-m", "prefix_router", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"prefix-router {command} --help: {result.stderr}"
    return result.stdout


@functools.cache
def envoy_help() -> str:
    result = subprocess.run([envoy_binary(), "--help"], capture_output=True, text=True, timeout=60)
    return result.stdout + result.stderr


def help_flags(text: str) -> dict[str, bool]:
    """Every flag a ``--help`` text names -> whether it takes a value."""
    flags: dict[str, bool] = {}
    for match in _FLAG.finditer(text):
        name, metavar = match.group(1), match.group(2)
        flags[name] = flags.get(name, False) or metavar is not None
    return flags


@dataclass
class ParsedArgs:
    positional: list[str] = field(default_factory=list)
    options: dict[str, list[str]] = field(default_factory=dict)

    def one(self, flag: str) -> str:
        values = self.options.get(flag, [])
        assert len(values) == 1, f"expected one {flag}, got {values}"
        return values[0]


def parse_args(tokens: Sequence[str], flags: Mapping[str, bool]) -> ParsedArgs:
    """Split ``tokens`` by the flags of a help text; an unknown flag fails the test."""
    parsed = ParsedArgs()
    items = list(tokens)
    i = 0
    while i < len(items):
        token = items[i]
        if token.startswith("-") and len(token) > 1:
            name, eq, inline = token.partition("=")
            assert name in flags, f"unknown flag {name} (known: {sorted(flags)})"
            if flags[name]:
                if eq:
                    value = inline
                else:
                    i += 1
                    assert i < len(items), f"{name} needs a value"
                    value = items[i]
            else:
                assert not eq, f"{name} takes no value"
                value = ""
            parsed.options.setdefault(name, []).append(value)
        else:
            parsed.positional.append(token)
        i += 1
    return parsed


def parse_cli(argv: Sequence[str]) -> tuple[str, ParsedArgs]:
    """``[SUBCOMMAND, *args]`` of the ``prefix-router`` entry point, checked against --help."""
    assert argv, "empty prefix-router command"
    command = argv[0]
    assert command in COMMANDS, f"{command!r} is not a prefix-router subcommand"
    parsed = parse_args(argv[1:], help_flags(cli_help(command)))
    assert not parsed.positional, f"prefix-router {command}: stray arguments {parsed.positional}"
    return command, parsed


def parse_envoy(argv: Sequence[str]) -> ParsedArgs:
    parsed = parse_args(argv, help_flags(envoy_help()))
    assert not parsed.positional, f"envoy: stray arguments {parsed.positional}"
    return parsed


def parse_shell(script: str) -> list[list[str]]:
    """``a ... && exec b ...`` -> ``[[a, ...], [b, ...]]`` (the only shell our files use)."""
    commands = []
    for part in script.split("&&"):
        words = shlex.split(part)
        if words and words[0] == "exec":
            words = words[1:]
        assert words, f"empty command in {script!r}"
        commands.append(words)
    return commands


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose-style ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$$``."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3)
        value = env.get(name)
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            assert op not in (":?", "?"), f"${{{name}}} is required: {arg}"
            return arg or ""
        return value or ""

    return _VAR.sub(sub, text)


# -- the helpers' own tests ----------------------------------------------------------------


DEPLOYED_COMMANDS = ("control-plane", "ext-proc", "sim", "envoy-bootstrap")
"""The subcommands containers run (compose/, deploy/k8s/)."""


@pytest.mark.parametrize("command", DEPLOYED_COMMANDS)
def test_deployed_subcommands_are_registered_and_have_help(command: str) -> None:
    assert command in COMMANDS
    assert "--help" in help_flags(cli_help(command))


def test_help_flags_know_values_and_switches() -> None:
    flags = help_flags(cli_help("control-plane"))
    assert flags["--xds-port"] and flags["--token-file"]
    assert not flags["--no-health-probe"]
    envoy = help_flags(envoy_help())
    assert envoy["-c"] and envoy["--concurrency"] and not envoy["--disable-hot-restart"]


def test_parse_cli_rejects_unknown_commands_and_flags() -> None:
    command, args = parse_cli(["ext-proc", "--port=50051", "--host", "0.0.0.0"])
    assert (command, args.one("--port"), args.one("--host")) == ("ext-proc", "50051", "0.0.0.0")
    with pytest.raises(AssertionError):
        parse_cli(["no-such-command"])
    with pytest.raises(AssertionError):
        parse_cli(["ext-proc", "--no-such-flag", "1"])


def test_interpolate_like_compose() -> None:
    env = {"A": "1", "E": ""}
    assert interpolate("${A:-x} ${B:-y} ${E:-z} ${E-w} $$HOME ${A}", env) == "1 y z  $HOME 1"
    with pytest.raises(AssertionError):
        interpolate("${B:?set B}", env)
