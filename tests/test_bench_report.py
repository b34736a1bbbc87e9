"""Fleet counters from vLLM's exposition, result persistence, and the goal verdicts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bench.bounds import CacheBounds
from bench.fleet_metrics import parse_metrics
from bench.report import check_goals, table, write_plots
from bench.results import InstanceStats, RequestRecord, RunResult, percentile
from vllm_sim import SimInstance, create_app, make_config


async def test_counters_parsed_from_the_simulators_metrics_match_its_state() -> None:
    instance = SimInstance(make_config(time_scale=1e6, num_gpu_blocks=1000), name="a")
    transport = httpx.ASGITransport(app=create_app(instance))
    body = {
        "model": instance.config.model,
        "max_tokens": 3,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "x" * 400}],
    }
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            for _ in range(3):
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            text = (await client.get("/metrics")).text
            state = (await client.get("/sim/state")).json()
    finally:
        await instance.stop()
    m = parse_metrics("http://sim", text)
    assert (m.queries, m.hits) == (state["prefix_cache_queries"], state["prefix_cache_hits"])
    assert m.hits > 0 and m.requests == 3 and m.generation_tokens == 9
    assert m.ttft_count == 3 and m.ttft_sum > 0
    assert (m.num_gpu_blocks, m.block_size) == (1000, 16)
    assert m.minus(m).queries == 0


def result(
    policy: str,
    ttfts: list[float],
    *,
    hits: int,
    workload: str = "rag",
    peak: int = 4,
    busy: float = 0.8,
    duration: float = 100.0,
) -> RunResult:
    records = [
        RequestRecord(arrival_s=i, instance="a", ttft_s=t, e2e_s=t + 1, output_tokens=10)
        for i, t in enumerate(ttfts)
    ]
    return RunResult(
        mode="live",
        workload=workload,
        policy=policy,
        params="",
        records=records,
        instances=[
            InstanceStats(
                id="a", requests=len(ttfts), peak_in_flight=peak, busy=busy, queries=1000, hits=hits
            )
        ],
        duration_s=duration,
        bounds=CacheBounds(0.95, 0.9, 1000, 100),
        notes={"concurrency_threshold": 16},
    )


def test_goal_verdicts_follow_the_numbers() -> None:
    rr = result("round-robin", [1.0] * 10, hits=300)
    good = result("prefix", [0.2] * 10, hits=850)  # 94% of the bound, -80% P50
    weak = result("prefix-spill", [0.3] * 10, hits=700)  # 78% of the bound, -70% P50
    lines = check_goals({"rag": [rr, good, weak]})
    text = "\n".join(lines)
    assert "80.0% busy (**met**" in text
    prefix_line = next(line for line in lines if "- prefix:" in line)
    spill_line = next(line for line in lines if "- prefix-spill:" in line)
    assert prefix_line.count("**met**") == 3
    assert spill_line.count("**missed**") == 2 and "-70%" in spill_line
    hot = check_goals(
        {
            "hot-prefix": [
                result("prefix", [0.1] * 99 + [5.0], hits=500, workload="hot-prefix", peak=40),
                result(
                    "prefix-spill", [0.1] * 99 + [2.0], hits=500, workload="hot-prefix", peak=17
                ),
            ]
        }
    )
    assert "peak in flight 17 per instance vs ConcurrencyThreshold 16 (**missed**)" in hot[0]
    assert hot[0].endswith("without spill (**met**)")
    unique = check_goals(
        {
            "unique": [
                result("round-robin", [0.20] * 10, hits=0, workload="unique"),
                result("prefix", [0.22] * 10, hits=0, workload="unique"),
                result("prefix-fixed", [0.18] * 10, hits=0, workload="unique"),
            ]
        }
    )
    assert "+10.0% vs round robin (**missed**" in unique[0]
    assert "-10.0% vs round robin (**met**" in unique[1]


def test_results_survive_json_and_render(tmp_path: Path) -> None:
    r = result("prefix", [0.1, 0.3, 0.2], hits=500)
    r.windows = [(0.0, 0.5), (30.0, 0.75)]
    r.events = [(10.0, "+1 -> 5 instances")]
    path = tmp_path / "r.json"
    r.save(path)
    back = RunResult.load(path)
    assert back == r
    assert back.ttft(50) == pytest.approx(0.2) and back.hit_rate == 0.5
    assert "| prefix | 50.0% | 55.6% | 200 |" in table([back])
    pngs = write_plots([back], tmp_path / "plots", "x", "test")
    assert len(pngs) == 4 and all(p.stat().st_size > 1000 for p in pngs)


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 3.0], 100) == 3.0
