"""How many streamed requests per second one simulator process sustains, and at what CPU cost.

Starts ``python -m vllm_sim`` (8 instances by default, a huge time scale so the simulator is
CPU-bound rather than sleeping) and drives it from this separate process over loopback with
a minimal keep-alive HTTP/1.1 client (httpx would cost more CPU than the simulator itself):
streaming chat completions with 4 KB prompts, a 2 KB prefix shared per instance plus 2 KB
unique. Reads the simulator's CPU time from /proc. Bounded by a request count and a time
limit. Not a test; prints one JSON summary (``--json`` also writes it to a file).

    .venv/bin/python bench/scripts/sim_throughput.py --requests 3000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.scripts._harness import Connection

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start_simulator(args: argparse.Namespace) -> tuple[subprocess.Popen[str], list[str]]:
    cmd = [
        sys.executable,
        "-m",
        "vllm_sim",
        "--instances",
        str(args.instances),
        "--base-port",
        "0",
        "--time-scale",
        str(args.time_scale),
        "--loop",
        args.loop,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
    )
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + 30
    while len(urls) < args.instances and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if " ready on " in line:
            urls.append(line.split(" ready on ")[1].split()[0])
    if len(urls) < args.instances:
        proc.kill()
        raise SystemExit("simulator did not start")
    return proc, urls


def make_body(i: int, n_instances: int, max_tokens: int) -> bytes:
    shared = f"System prompt of tenant {i % n_instances}. " * 64
    unique = f"Question {i}: " + "lorem ipsum dolor sit amet " * 80
    content = shared[:2048] + unique[:2048]
    return json.dumps(
        {
            "model": "meta-llama/Llama-3.1-70B-Instruct",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def drive(urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    counter = itertools.count()
    done = errors = tokens = 0
    deadline = time.monotonic() + args.max_seconds
    targets = [httpx.URL(u) for u in urls]

    async def worker(slot: int) -> None:
        nonlocal done, errors, tokens
        conns = [Connection(t.host, t.port or 80) for t in targets]
        try:
            while time.monotonic() < deadline:
                i = next(counter)
                if i >= args.requests:
                    return
                conn = conns[i % len(conns)]
                try:
                    status, body = await conn.post(
                        "/v1/chat/completions", make_body(i, len(urls), args.max_tokens)
                    )
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    errors += 1
                    conn.close()
                    conns[i % len(conns)] = Connection(conn.host, conn.port)
                    continue
                if status != 200 or not body.endswith(b"data: [DONE]\n\n"):
                    errors += 1
                    continue
                tokens += body.count(b'"delta":{"content"')
                done += 1
        finally:
            for conn in conns:
                conn.close()

    start = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(args.concurrency)))
    elapsed = time.monotonic() - start
    # Sanity check with a real HTTP client: the stream parses as OpenAI SSE.
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(
            urls[0] + "/v1/chat/completions",
            content=make_body(0, len(urls), args.max_tokens),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    return {"done": done, "errors": errors, "tokens": tokens, "elapsed_s": elapsed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--requests", type=int, default=3000, help="stop after this many")
    p.add_argument("--max-seconds", type=float, default=60.0, help="or after this long")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=1e6)
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args()

    proc, urls = start_simulator(args)
    try:
        sim_cpu0 = cpu_seconds(proc.pid)
        me0 = resource.getrusage(resource.RUSAGE_SELF)
        result = asyncio.run(drive(urls, args))
        sim_cpu = cpu_seconds(proc.pid) - sim_cpu0
        me1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    driver_cpu = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
    n = max(result["done"], 1)
    summary = {
        **result,
        "instances": args.instances,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_bytes": 4096,
        "requests_per_s": result["done"] / result["elapsed_s"],
        "tokens_per_s": result["tokens"] / result["elapsed_s"],
        "sim_cpu_s": sim_cpu,
        "sim_cpu_util": sim_cpu / result["elapsed_s"],
        "sim_cpu_ms_per_request": 1e3 * sim_cpu / n,
        "sim_capacity_req_per_cpu_s": n / sim_cpu if sim_cpu else float("inf"),
        "driver_cpu_ms_per_request": 1e3 * driver_cpu / n,
    }
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
