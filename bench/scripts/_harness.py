"""Shared helpers for the benchmark scripts: a static stack on loopback and wrk."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (results are written under ``bench/results``)."""

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def run_heading(when: datetime.datetime | None = None) -> str:
    """A results file's heading for one run: when (UTC) and what code (the commit, ``+``
    if the tree had changes), so runs appended to one file stay told apart."""
    when = when or datetime.datetime.now(datetime.UTC)
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty=+"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown commit"
    return f"### Run of {when:%Y-%m-%d %H:%M} UTC at {commit}"


def require_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk is None:
        sys.exit("this benchmark drives load with wrk: apt-get install wrk")
    return wrk


def chat_body(size: int) -> bytes:
    """An OpenAI chat body of about ``size`` bytes."""
    filler = "lorem ipsum dolor sit amet " * (size // 27 + 1)
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": filler[: max(0, size - 120)]},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 16,
    }
    return json.dumps(body).encode()


def run_wrk(
    url: str, body: bytes, *, connections: int, threads: int, seconds: int
) -> dict[str, float]:
    """p50/p99 latency (ms) and requests/s of ``POST url`` with ``body``."""
    with tempfile.TemporaryDirectory() as tmp:
        body_file = Path(tmp) / "body.json"
        body_file.write_bytes(body)
        script = Path(tmp) / "post.lua"
        script.write_text(
            'wrk.method = "POST"\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
            f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\nf:close()\n'
        )
        out = subprocess.run(
            [
                require_wrk(),
                "-t",
                str(threads),
                "-c",
                str(connections),
                "-d",
                f"{seconds}s",
                "--latency",
                "-s",
                str(script),
                url,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 30,
        ).stdout
    result = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    for pct in ("50", "99"):
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        result[f"p{pct}"] = float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    result["errors"] = float(errors.group(1)) if errors else 0.0
    return result


class Connection:
    """A minimal keep-alive HTTP/1.1 client over asyncio streams.

    httpx costs more CPU per streamed request than the simulator itself, so with two cores
    it would measure the driver; this reads chunked SSE bodies with a few C-level calls.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        raw_head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw_head[9:12])
        headers = raw_head.lower()
        if b"transfer-encoding: chunked" in headers:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                data = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                parts.append(data[:-2])
            return status, b"".join(parts)
        length = int(headers.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class CpuCap:
    """Confine processes to ``cores`` CPUs with a cgroup CPU quota (needs root).

    Scaling benchmarks on a small machine: capping each ext_proc leaves the machine
    headroom, so adding a process can show the throughput it adds. Uses the cgroup v1
    ``cpu`` controller or, on a pure cgroup v2 host, ``cpu.max``.
    """

    PERIOD_US = 100_000

    def __init__(self, name: str, cores: float) -> None:
        v1 = Path("/sys/fs/cgroup/cpu")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.root, self.v2 = v1, False
        elif "cpu" in (v2 / "cgroup.controllers").read_text(errors="ignore").split():
            self.root, self.v2 = v2, True
        else:
            sys.exit("no cgroup cpu controller: run without --cpu-cap")
        self.path = self.root / name
        quota = max(1000, int(cores * self.PERIOD_US))
        try:
            self.path.mkdir(exist_ok=True)
            if self.v2:
                (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except PermissionError:
            sys.exit("creating a cgroup needs root: run without --cpu-cap")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Move what is left back to the root group and delete the group."""
        procs = self.path / "cgroup.procs"
        for pid in procs.read_text().split() if procs.exists() else ():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        try:
            self.path.rmdir()
        except OSError:
            pass


def checkout_env(tree: Path | str) -> dict[str, str]:
    """The environment that makes a child Python import the router from ``tree``, another
    checkout (a ``git worktree``), checked: it exits if the child would import this one.

    ``PYTHONPATH`` alone is not enough: ``python -m ...`` puts its working directory first
    on ``sys.path``, so a child started from this repository's root imports this
    checkout's code, not ``tree``'s, and a comparison with a baseline measures the same
    code twice. ``PYTHONSAFEPATH`` (Python 3.11) leaves the working directory out."""
    root = Path(tree).resolve()
    env = {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", "import ext_proc, prefix_router; print(ext_proc.__file__)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    imported = Path(probe.stdout.strip() or "?").resolve()
    if probe.returncode != 0 or root not in imported.parents:
        sys.exit(
            f"{root}: a child would import ext_proc from {imported}, not from this checkout"
            f"{': ' + probe.stderr[-500:] if probe.returncode else ''}"
        )
    return env


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def rss_table(samples: list[tuple[float, dict[str, float]]], names: list[str]) -> list[str]:
    """Markdown rows: each component's RSS (MB) at each sample's minute."""
    return [
        "| minute | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
        *[
            f"| {at / 60:.1f} | "
            + " | ".join(f"{rss.get(k, float('nan')):.1f}" for k in names)
            + " |"
            for at, rss in samples
        ],
    ]


def median_rounds(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each path's figures, each the median over rounds (errors: the sum)."""
    return {
        name: {
            stat: (
                sum(r[name][stat] for r in rounds)
                if stat == "errors"
                else statistics.median(r[name][stat] for r in rounds)
            )
            for stat in rounds[0][name]
        }
        for name in rounds[0]
    }


def latency_in_rounds(
    urls: dict[str, str], body: bytes, *, seconds: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Each path's wrk figures at concurrency 1, measured in ``rounds`` rounds with the paths
    taking turns, each figure the median round's (the machine drifts more between two
    moments than two paths differ)."""
    return median_rounds(
        [
            {
                name: run_wrk(url, body, connections=1, threads=1, seconds=seconds)
                for name, url in urls.items()
            }
            for _ in range(rounds)
        ]
    )
