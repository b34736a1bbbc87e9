"""The fleet's own view of a run: vLLM's Prometheus counters scraped before and after.

Works against real vLLM servers as well as the simulator: everything comes from
``/metrics`` with vLLM's names (``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``, ``vllm:request_success_total``, the TTFT histogram's
``_sum``/``_count``, ``vllm:cache_config_info``'s ``num_gpu_blocks``), summed over the
``engine`` label. The simulator also answers ``/sim/state``, whose ``sim_time_s`` is the
time its engine spent stepping: the instance's busy time.

A :class:`Sampler` polls the running and waiting gauges while the run lasts, for the
instance-side peak in flight when responses do not name their instance.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = {
    "vllm:prefix_cache_queries": "queries",
    "vllm:prefix_cache_hits": "hits",
    "vllm:request_success": "requests",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:num_preemptions": "preemptions",
}


@dataclass(slots=True)
class InstanceMetrics:
    url: str
    queries: float = 0.0
    hits: float = 0.0
    requests: float = 0.0
    """Finished requests (any reason but abort)."""
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    in_flight: float = 0.0
    """Running + waiting requests (a gauge)."""
    busy_s: float | None = None
    """Simulator only: simulated seconds spent stepping."""
    peak_in_flight: int | None = None
    """Simulator only: the most requests the instance held at once since it started."""

    def minus(self, before: InstanceMetrics) -> InstanceMetrics:
        """Counters over the interval since ``before`` (gauges and config kept as now)."""
        busy = None
        if self.busy_s is not None and before.busy_s is not None:
            busy = self.busy_s - before.busy_s
        return InstanceMetrics(
            url=self.url,
            queries=self.queries - before.queries,
            hits=self.hits - before.hits,
            requests=self.requests - before.requests,
            generation_tokens=self.generation_tokens - before.generation_tokens,
            preemptions=self.preemptions - before.preemptions,
            ttft_sum=self.ttft_sum - before.ttft_sum,
            ttft_count=self.ttft_count - before.ttft_count,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            in_flight=self.in_flight,
            busy_s=busy,
            peak_in_flight=self.peak_in_flight,
        )


def parse_metrics(url: str, text: str) -> InstanceMetrics:
    """One instance's counters from its Prometheus text exposition."""
    out = InstanceMetrics(url=url)
    for family in text_string_to_metric_families(text):
        name = family.name
        for sample in family.samples:
            if name in _COUNTERS and sample.name.endswith("_total"):
                reason = sample.labels.get("finished_reason")
                if name == "vllm:request_success" and reason == "abort":
                    continue
                attr = _COUNTERS[name]
                setattr(out, attr, getattr(out, attr) + sample.value)
            elif name == "vllm:time_to_first_token_seconds":
                if sample.name.endswith("_sum"):
                    out.ttft_sum += sample.value
                elif sample.name.endswith("_count"):
                    out.ttft_count += sample.value
            elif name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                out.in_flight += sample.value
            elif name == "vllm:cache_config_info":
                with contextlib.suppress(KeyError, ValueError):
                    out.num_gpu_blocks = int(sample.labels["num_gpu_blocks"])
                    out.block_size = int(sample.labels["block_size"])
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> InstanceMetrics:
    """``/metrics`` (and, if the instance is a simulator, ``/sim/state``) of one instance."""
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    metrics = parse_metrics(url, response.text)
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        state = await client.get(f"{url}/sim/state")
        if state.status_code == 200:
            snapshot = state.json()
            metrics.busy_s = float(snapshot["sim_time_s"])
            if "peak_in_flight" in snapshot:
                metrics.peak_in_flight = int(snapshot["peak_in_flight"])
    return metrics


async def scrape_fleet(urls: Sequence[str], *, timeout_s: float = 10.0) -> list[InstanceMetrics]:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        return list(await asyncio.gather(*(scrape(client, u) for u in urls)))


@dataclass
class Sampler:
    """Polls every instance's running + waiting gauges; keeps the peak per instance."""

    urls: Sequence[str]
    interval_s: float = 0.5
    peaks: dict[str, int] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start polling (the HTTP client is built now, not in the middle of the run)."""
        client = httpx.AsyncClient(timeout=5.0)
        self._task = asyncio.get_running_loop().create_task(self._run(client))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, client: httpx.AsyncClient) -> None:
        async with client:
            while True:
                for url in self.urls:
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        response = await client.get(f"{url}/metrics")
                        value = int(parse_metrics(url, response.text).in_flight)
                        self.peaks[url] = max(self.peaks.get(url, 0), value)
                await asyncio.sleep(self.interval_s)
