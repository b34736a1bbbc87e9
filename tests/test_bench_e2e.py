"""``prefix-router bench run`` end to end: real Envoy, ext_proc, control plane and Redis over
two simulated instances, a few dozen requests per policy, every process stopped after."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from bench.results import RunResult
from bench.workloads import generate
from prefix_router.ops.cli import main
from tests.support.processes import children, kill_with_groups, new_since

pytestmark = pytest.mark.e2e

PARAMS = {
    "requests": 32,
    "rate": 4,
    "prompts": 4,
    "prompt_tokens": 400,
    "output_min": 4,
    "output_max": 12,
}
WORKLOAD = [
    "--workload",
    "system-prompt",
    *(arg for k, v in PARAMS.items() for arg in ("--set", f"{k}={v}")),
]


def test_bench_run_round_robin_and_prefix_through_the_real_stack(tmp_path: Path) -> None:
    before = children()
    try:
        code = main(
            [
                "bench",
                "run",
                *WORKLOAD,
                "--policies",
                "round-robin,prefix",
                "--instances",
                "2",
                "--time-scale",
                "20",
                "--ext-procs",
                "1",
                "--max-duration",
                "120",
                "--out",
                str(tmp_path),
                "--work-dir",
                str(tmp_path / "work"),
            ]
        )
    finally:
        left = new_since(before)  # on every path: none may outlive the run, nor this test
        kill_with_groups(left)
    assert code == 0
    assert left == [], "every process the benchmark started must be stopped"

    rr = RunResult.load(tmp_path / "system-prompt" / "live-round-robin.json")
    prefix = RunResult.load(tmp_path / "system-prompt" / "live-prefix.json")
    for result in (rr, prefix):
        assert len(result.records) == 32 and result.errors == 0
        assert all(
            r.ttft_s is not None and r.e2e_s is not None and r.e2e_s >= r.ttft_s
            for r in result.records
        )
        assert sum(i.requests for i in result.instances) == 32  # from the fleet's counters
        assert result.bounds is not None and 0 < result.bounds.fleet_lru <= 1
        # peak in flight is the instances' own high-water mark, at least 1 where requests ran
        assert all(i.peak_in_flight >= 1 for i in result.instances if i.requests)
    assert all(i.requests > 8 for i in rr.instances)  # Envoy round robin over both

    # ext_proc's key reached Envoy's ring: with pure affinity (``prefix``: no spill) each
    # system prompt stayed on the instance that first served it
    served: dict[str, set[str | None]] = defaultdict(set)
    groups = [a.group for a in generate("system-prompt", PARAMS)]
    for group, record in zip(groups, prefix.records, strict=True):
        served[group].add(record.instance)
    assert all(len(s) == 1 for s in served.values())
    assert prefix.hit_rate > rr.hit_rate

    report = (tmp_path / "report.md").read_text()
    assert "| prefix |" in report and "| round-robin |" in report
    pngs = list((tmp_path / "plots").glob("*.png"))
    assert len(pngs) == 3 and all(0 < p.stat().st_size < 200_000 for p in pngs)
