"""Live runs: one workload under one policy through the real stack over simulated instances.

For every policy a fresh set of simulated vLLM instances is started (cold caches), then:

* ``prefix`` / ``prefix-spill``: the whole router as ``prefix-router up`` runs it
  (:class:`prefix_router.ops.up.Stack`: Redis, control plane with xDS, ext_proc workers,
  Envoy with RING_HASH on ``x-prefix-key``), with the policy's spill rule;
* ``round-robin`` / ``least-request``: the same Envoy binary and bootstrap over the same
  instances, with the cluster's ``lb_policy`` set accordingly and the ext_proc filter
  turned off on the route (there is no key to compute).

The driver (:mod:`bench.driver`) sends the workload through Envoy; the
instances' ``/metrics`` are scraped before and after (:mod:`.fleet_metrics`). Every
process started here is stopped by PID on the way out, also on failure or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import yaml

from bench.bounds import BoundsTracker, CacheBounds
from bench.driver import DriveOutcome, DriverSettings, Sent, drive
from bench.fleet_metrics import InstanceMetrics, Sampler, scrape_fleet
from bench.policies import Policy
from bench.results import InstanceStats, RequestRecord, RunResult
from bench.spec import Workload
from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.envoy.bootstrap import BootstrapParams
from prefix_router.ops.launch import start_envoy, start_module, wait_routable
from prefix_router.ops.procs import ManagedProcess, free_port
from prefix_router.ops.up import Stack, UpSettings
from vllm_sim.protocol import chat_prompt_tokens, completion_prompt_tokens
from vllm_sim.tokenizer import tokenize

HOST = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class LiveSettings:
    router: RouterConfig = field(default_factory=RouterConfig)
    instances: int = 4
    sim_profile: str = "llama-3.1-70b-8xh100"
    sim_args: tuple[str, ...] = ()
    """Extra simulator flags, e.g. ``("--num-gpu-blocks", "8192")``."""
    sim_procs: int = 1
    """Simulator processes the instances are spread over (CPU)."""
    time_scale: float = 1.0
    ext_procs: int = 2
    envoy_concurrency: int = 2
    max_duration_s: float = 1800.0
    request_timeout_s: float = 600.0
    work_dir: Path | None = None
    """Logs and rendered configs; a temporary folder when None."""


@contextlib.contextmanager
def simulated_fleet(settings: LiveSettings, log_dir: Path) -> Iterator[list[str]]:
    """Start the simulated instances; yields their URLs; stops them on exit."""
    ports = [free_port(HOST) for _ in range(settings.instances)]
    procs: list[ManagedProcess] = []
    groups = [ports[i :: settings.sim_procs] for i in range(settings.sim_procs)]
    try:
        for index, group in enumerate(g for g in groups if g):
            args = [
                "--ports",
                ",".join(map(str, group)),
                "--host",
                HOST,
                "--profile",
                settings.sim_profile,
                "--time-scale",
                str(settings.time_scale),
                *settings.sim_args,
            ]
            procs.append(
                start_module(f"vllm-sim-{index}", "vllm_sim", args, log_dir, ready_ports=group)
            )
        yield [f"http://{HOST}:{p}" for p in ports]
    finally:
        for proc in reversed(procs):
            proc.stop(grace=5.0)


@contextlib.contextmanager
def policy_stack(
    policy: Policy, urls: Sequence[str], settings: LiveSettings, run_dir: Path
) -> Iterator[str]:
    """Start the router for ``policy`` in front of ``urls``; yields the data-plane URL."""
    if policy.simulated_only:
        raise ValueError(f"policy {policy.value!r} runs in the simulation only (bench des)")
    config = policy.router_config(settings.router)
    if policy.uses_router:
        config_file = run_dir / "routing.yaml"
        config_file.parent.mkdir(parents=True, exist_ok=True)
        config_file.write_text(yaml.safe_dump({"routing": config.to_json_dict()}))
        up = UpSettings(
            host=HOST,
            port=free_port(HOST),
            admin_port=free_port(HOST),
            envoy_admin_port=free_port(HOST),
            xds_port=free_port(HOST),
            ext_procs=settings.ext_procs,
            envoy_concurrency=settings.envoy_concurrency,
            backend=[f"{url}:1:vllm-{i}" for i, url in enumerate(urls)],
            config=str(config_file),
            run_dir=str(run_dir),
            namespace="prefix-router-bench:",
            clock_scale=settings.time_scale,
        )
        stack = Stack(up, config)
        try:
            stack.start()
            yield f"http://{HOST}:{up.port}"
        finally:
            stack.stop()
        return
    fleet = Fleet.of([Instance.from_url(url) for url in urls])
    params = BootstrapParams(
        listen_address=HOST,
        listen_port=free_port(HOST),
        admin_address=HOST,
        admin_port=free_port(HOST),
        ext_proc=(),
        lb_policy=policy.envoy_lb_policy,
    )
    envoy = start_envoy(
        params, config, run_dir / "logs", fleet=fleet, concurrency=settings.envoy_concurrency
    )
    try:
        base = f"http://{HOST}:{params.listen_port}"
        wait_routable(base, model_of(urls[0]), [envoy])
        yield base
    finally:
        envoy.stop(grace=5.0)


def model_of(url: str) -> str:
    """The served model of the instance at ``url`` (``/v1/models``)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


def run_live(
    workload: Workload,
    policy: Policy,
    settings: LiveSettings,
    *,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Start instances and the policy's stack, drive ``workload`` through it, stop them."""
    with contextlib.ExitStack() as stack:
        if settings.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        else:
            work = settings.work_dir
        run_dir = work / f"{workload.name.replace(':', '-')}-{policy.value}"
        urls = stack.enter_context(simulated_fleet(settings, run_dir / "logs"))
        base_url = stack.enter_context(policy_stack(policy, urls, settings, run_dir))
        model = model_of(urls[0])
        driver = DriverSettings(
            base_url=base_url,
            model=model,
            time_scale=settings.time_scale,
            max_duration_s=settings.max_duration_s,
            request_timeout_s=settings.request_timeout_s,
        )
        return measure(workload, policy.value, driver, urls, on_done=on_done)
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow


def measure(
    workload: Workload,
    policy: str,
    driver: DriverSettings,
    urls: Sequence[str],
    *,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Drive ``workload`` through ``driver.base_url``; the fleet at ``urls`` is measured."""

    async def go() -> tuple[
        list[InstanceMetrics], list[InstanceMetrics], DriveOutcome, dict[str, int], float
    ]:
        before = await scrape_fleet(urls)
        sampler = Sampler(urls)
        sampler.start()
        started = time.perf_counter()
        try:
            outcome = await drive(workload, driver, on_done=on_done)
        finally:
            await sampler.stop()
        wall = time.perf_counter() - started
        after = await scrape_fleet(urls)
        return before, after, outcome, sampler.peaks, wall

    before, after, outcome, sampled, wall = _run_async(go())
    deltas = [a.minus(b) for a, b in zip(after, before, strict=True)]
    instances = _instance_stats(urls, deltas, outcome, sampled, wall * driver.time_scale)
    capacity = sum(d.num_gpu_blocks or 0 for d in deltas)
    ttft_count = sum(d.ttft_count for d in deltas)
    return RunResult(
        mode="live",
        workload=workload.name,
        policy=policy,
        params="",
        records=outcome.records,
        instances=instances,
        duration_s=outcome.duration_s,
        bounds=compute_bounds(outcome.sent, outcome.records, capacity, driver.model),
        time_scale=driver.time_scale,
        notes={
            "wall_s": round(outcome.wall_s, 1),
            "not_sent": workload.num_requests - len(outcome.records),
            "instance_mean_ttft_s": sum(d.ttft_sum for d in deltas) / ttft_count
            if ttft_count
            else None,
            "preemptions": sum(d.preemptions for d in deltas),
        },
    )


def _run_async(
    coro: object,
) -> tuple[list[InstanceMetrics], list[InstanceMetrics], DriveOutcome, dict[str, int], float]:
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)  # type: ignore[arg-type]


def _port(url: str) -> str:
    return url.rsplit(":", 1)[-1].rstrip("/")


def _instance_stats(
    urls: Sequence[str],
    deltas: Sequence[InstanceMetrics],
    outcome: DriveOutcome,
    sampled: dict[str, int],
    model_span_s: float,
) -> list[InstanceStats]:
    by_port = {_port(u): u for u in urls}
    client_peaks = {by_port.get(k, k): v for k, v in outcome.peaks.items()}
    for record in outcome.records:
        if record.instance is not None and record.instance in by_port:
            record.instance = by_port[record.instance].split("://", 1)[-1]
    stats = []
    for url, d in zip(urls, deltas, strict=True):
        stats.append(
            InstanceStats(
                id=url.split("://", 1)[-1],
                requests=int(d.requests),
                peak_in_flight=d.peak_in_flight
                if d.peak_in_flight is not None
                else client_peaks.get(url, sampled.get(url, 0)),
                busy=min(1.0, d.busy_s / model_span_s)
                if d.busy_s is not None and model_span_s
                else None,
                queries=int(d.queries),
                hits=int(d.hits),
                mean_ttft_s=d.ttft_sum / d.ttft_count if d.ttft_count else None,
            )
        )
    return stats


def compute_bounds(
    sent: Sequence[Sent], records: Sequence[RequestRecord], capacity_blocks: int, model: str
) -> CacheBounds | None:
    """Offline bounds over what was sent, in send order, with the simulator's tokenizer."""
    if capacity_blocks < 1:
        return None
    tracker = BoundsTracker(capacity_blocks=capacity_blocks)
    for request, record in zip(sent, records, strict=True):
        if record.error is not None:
            continue
        data = orjson.loads(request.body)
        prompt = (
            chat_prompt_tokens(data)
            if request.endpoint == "chat"
            else completion_prompt_tokens(data)
        )
        tracker.add_tokens(prompt, tokenize(request.output), model=model)
    return tracker.result()
