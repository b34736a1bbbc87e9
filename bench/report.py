"""Markdown tables and PNG plots from run results (matplotlib, Agg backend).

Per workload: a table with one row per policy (token hit rate and the offline bounds,
TTFT P50/P99 and the change against round robin, throughput, busy, peak in flight), and
three plots: TTFT CDF per policy, hit rate per policy against the bounds, requests and
peak in flight per instance. A DES run with resizes adds the hit rate over time.
:func:`check_goals` states which of the issue's goals a set of results meets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

from bench.results import RunResult

BASELINE = "round-robin"
PREFIX_POLICIES = ("prefix", "prefix-spill", "prefix-fixed")
"""The policies whose goals are checked, in the order the goal lines list them."""
_COLORS = {
    "round-robin": "#7f7f7f",
    "least-request": "#bcbd22",
    "prefix": "#1f77b4",
    "prefix-spill": "#d62728",
    "prefix-fixed": "#ff7f0e",
    "cache-aware": "#2ca02c",
}


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 100:.1f}%"


def _change(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return "-"
    return f"{(value / base - 1) * 100:+.0f}%"


def baseline_of(results: Sequence[RunResult]) -> RunResult | None:
    return next((r for r in results if r.policy == BASELINE), None)


def table(results: Sequence[RunResult]) -> str:
    """One row per policy; changes are against round robin when it is among ``results``."""
    base = baseline_of(results)
    lines = [
        "| policy | token hit rate | of fleet-LRU bound | TTFT P50 ms | vs RR | TTFT P99 ms "
        "| vs RR | throughput req/s | vs RR | output tok/s | busy min/mean | peak in flight "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        bound = r.bounds.fleet_lru if r.bounds else None
        of_bound = r.hit_rate / bound if bound else None
        p50, p99 = r.ttft(50), r.ttft(99)
        busy = "-" if r.min_busy is None else f"{r.min_busy:.0%} / {r.mean_busy:.0%}"
        lines.append(
            f"| {r.policy} | {_pct(r.hit_rate)} | {_pct(of_bound)} | {_ms(p50)} | "
            f"{_change(p50, base.ttft(50)) if base else '-'} | {_ms(p99)} | "
            f"{_change(p99, base.ttft(99)) if base else '-'} | {r.throughput_rps:.2f} | "
            f"{_change(r.throughput_rps, base.throughput_rps) if base else '-'} | "
            f"{r.output_tps:,.0f} | {busy} | {r.peak_in_flight} | {r.errors} |"
        )
    bounds = next((r.bounds for r in results if r.bounds), None)
    if bounds:
        lines.append("")
        lines.append(
            f"Offline bounds over the same request sequence: infinite cache "
            f"{_pct(bounds.infinite)}, one LRU cache of the fleet's size "
            f"({bounds.capacity_blocks:,} blocks of 16 tokens) {_pct(bounds.fleet_lru)}."
        )
    return "\n".join(lines)


HEADLINE_POLICIES = ("round-robin", "least-request", "prefix", "prefix-spill")


def headline_table(by_workload: Mapping[str, Sequence[RunResult]]) -> str:
    """One row per workload; each cell lists RR / LR / prefix / prefix-spill."""

    def cells(results: Sequence[RunResult], fmt: Callable[[RunResult], str]) -> str:
        by_policy = {r.policy: r for r in results}
        return " / ".join(fmt(by_policy[p]) if p in by_policy else "-" for p in HEADLINE_POLICIES)

    lines = [
        "| workload | token hit rate | fleet-LRU bound | TTFT P50 ms | TTFT P99 ms "
        "| throughput req/s | peak in flight | prefix-spill P50 vs RR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, results in by_workload.items():
        bounds = next((r.bounds for r in results if r.bounds), None)
        base = baseline_of(results)
        spill = next((r for r in results if r.policy == "prefix-spill"), None)
        change = _change(spill.ttft(50), base.ttft(50)) if spill and base else "-"
        lines.append(
            f"| {workload} | {cells(results, lambda r: _pct(r.hit_rate))} | "
            f"{_pct(bounds.fleet_lru) if bounds else '-'} | "
            f"{cells(results, lambda r: _ms(r.ttft(50)))} | "
            f"{cells(results, lambda r: _ms(r.ttft(99)))} | "
            f"{cells(results, lambda r: f'{r.throughput_rps:.2f}')} | "
            f"{cells(results, lambda r: str(r.peak_in_flight))} | **{change}** |"
        )
    return "\n".join([f"Each cell: {' / '.join(HEADLINE_POLICIES)}.", "", *lines])


def _rel(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{(a / b - 1) * 100:+.1f}%"


def agreement_table(live: Sequence[RunResult], des: Sequence[RunResult]) -> str:
    """The same workload and policies, live vs simulated: how far apart, per measure.

    The instance-side mean TTFT (the simulator's own histogram, in simulated seconds) is
    the like-for-like comparison; the client-side P50 adds the harness's and the proxy's
    wall-clock overheads, which the simulation has not.
    """
    by_policy = {r.policy: r for r in des}
    lines = [
        "| policy | hit rate live / DES | diff | mean TTFT ms, instance-side live / DES | diff "
        "| P50 TTFT ms, client live / DES | diff | throughput req/s live / DES | diff "
        "| peak in flight live / DES |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in live:
        d = by_policy.get(r.policy)
        if d is None:
            continue
        live_mean = r.notes.get("instance_mean_ttft_s")
        ttfts = d.ttfts()
        des_mean = sum(ttfts) / len(ttfts) if ttfts else math.nan
        lines.append(
            f"| {r.policy} | {_pct(r.hit_rate)} / {_pct(d.hit_rate)} | "
            f"{(r.hit_rate - d.hit_rate) * 100:+.1f} pt | "
            f"{_ms(live_mean if live_mean is not None else math.nan)} / {_ms(des_mean)} | "
            f"{_rel(live_mean, des_mean)} | {_ms(r.ttft(50))} / {_ms(d.ttft(50))} | "
            f"{_rel(r.ttft(50), d.ttft(50))} | {r.throughput_rps:.2f} / {d.throughput_rps:.2f} | "
            f"{_rel(r.throughput_rps, d.throughput_rps)} | {r.peak_in_flight} / "
            f"{d.peak_in_flight} |"
        )
    return "\n".join(lines)


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "figure.dpi": 80})
    return plt


def plot_ttft_cdf(results: Sequence[RunResult], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for r in results:
        values = r.ttfts()
        if not values:
            continue
        step = max(1, len(values) // 400)
        xs = [v * 1000 for v in values[::step]]
        ys = [i * step / len(values) for i in range(len(xs))]
        ax.plot(xs, ys, label=r.policy, color=_COLORS.get(r.policy))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, model time)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_hit_rate(results: Sequence[RunResult], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r.policy for r in results]
    ax.bar(
        names, [r.hit_rate * 100 for r in results], color=[_COLORS.get(n, "#333333") for n in names]
    )
    bounds = next((r.bounds for r in results if r.bounds), None)
    if bounds:
        ax.axhline(bounds.infinite * 100, ls="--", color="black", lw=1, label="infinite cache")
        ax.axhline(bounds.fleet_lru * 100, ls=":", color="green", lw=1.5, label="fleet-sized LRU")
        ax.legend(loc="lower right")
    ax.set_ylim(0, 100)
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"Prefix-cache hit rate: {title}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_instances(results: Sequence[RunResult], path: Path, title: str) -> None:
    """Instance ``k`` of every run side by side (each run starts its own instances; the
    ``k``-th has ring identity ``vllm-k`` in every run, live or simulated)."""
    plt = _pyplot()
    count = max((len(r.instances) for r in results), default=0)
    many = count > 16
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 4.6), sharex=True)
    width = 0.8 / max(1, len(results))
    for k, r in enumerate(results):
        color = _COLORS.get(r.policy)
        requests = [i.requests for i in r.instances]
        peaks = [i.peak_in_flight for i in r.instances]
        if many:  # too many bars: each policy's instances sorted, busiest first
            ranks = range(len(requests))
            top.step(ranks, sorted(requests, reverse=True), label=r.policy, color=color)
            bottom.step(ranks, sorted(peaks, reverse=True), color=color)
            continue
        xs = [j + k * width for j in range(len(requests))]
        top.bar(xs, requests, width, label=r.policy, color=color)
        bottom.bar(xs, peaks, width, color=color)
    threshold = next(
        (
            r.notes.get("concurrency_threshold")
            for r in results
            if r.notes.get("concurrency_threshold")
        ),
        None,
    )
    if threshold:
        bottom.axhline(threshold, ls=":", color="black", lw=1, label="ConcurrencyThreshold")
        bottom.legend(fontsize=7, loc="upper right")
    top.set_ylabel("requests")
    bottom.set_ylabel("peak in flight")
    top.set_title(f"Per instance: {title}")
    top.legend(fontsize=7, ncol=len(results))
    if many:
        bottom.set_xlabel(f"instances ranked by the value shown ({count} instances)")
    else:
        bottom.set_xticks([j + 0.4 - width / 2 for j in range(count)])
        bottom.set_xticklabels([f"vllm-{j}" for j in range(count)])
        bottom.set_xlabel("instance")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_windows(results: Sequence[RunResult], path: Path, title: str) -> None:
    """Hit rate over arrival time, with the fleet's resizes marked (DES)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for r in results:
        if r.windows:
            ax.plot(
                [w[0] for w in r.windows],
                [w[1] * 100 for w in r.windows],
                label=r.policy,
                color=_COLORS.get(r.policy),
            )
    events = next((r.events for r in results if r.events), [])
    for at, what in events:
        ax.axvline(at, color="black", ls="--", lw=0.8)
        ax.annotate(what, (at, 3), fontsize=7, rotation=90, va="bottom", ha="right")
    ax.set_ylim(0, 100)
    ax.set_xlabel("arrival time (s, model time)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"Hit rate over time: {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_plots(results: Sequence[RunResult], folder: Path, stem: str, title: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [
        folder / f"{stem}-ttft-cdf.png",
        folder / f"{stem}-hit-rate.png",
        folder / f"{stem}-instances.png",
    ]
    plot_ttft_cdf(results, paths[0], title)
    plot_hit_rate(results, paths[1], title)
    plot_instances(results, paths[2], title)
    if any(r.windows and r.events for r in results):
        paths.append(folder / f"{stem}-hit-rate-over-time.png")
        plot_windows(results, paths[-1], title)
    return paths


def check_goals(
    by_workload: Mapping[str, Sequence[RunResult]], threshold: int | None = None
) -> list[str]:
    """The issue's goals, each as a line stating the measured figures and met / missed."""
    lines = []

    def get(workload: str, policy: str) -> RunResult | None:
        return next((r for r in by_workload.get(workload, ()) if r.policy == policy), None)

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    for workload in ("system-prompt", "rag"):
        rr = get(workload, BASELINE)
        if rr is None:
            continue
        busy = rr.min_busy
        lines.append(
            f"- {workload}: round robin keeps every instance >= {_pct(busy)} busy "
            f"({verdict(busy is not None and busy >= 0.6)} the >= 60% load condition)"
        )
        for policy in PREFIX_POLICIES:
            r = get(workload, policy)
            if r is None or r.bounds is None:
                continue
            of_bound = r.hit_rate / r.bounds.fleet_lru if r.bounds.fleet_lru else 0.0
            p50 = r.ttft(50) / rr.ttft(50) - 1
            tput = r.throughput_rps / rr.throughput_rps - 1 if rr.throughput_rps else 0.0
            lines.append(
                f"  - {policy}: hit rate {_pct(r.hit_rate)} = {of_bound:.0%} of the fleet-LRU "
                f"bound ({verdict(of_bound >= 0.9)}, goal >= 90%); P50 TTFT {p50 * 100:+.0f}% "
                f"vs round robin ({verdict(p50 <= -0.77)}, goal <= -77%); throughput "
                f"{tput * 100:+.1f}% ({verdict(tput >= -0.005)}, goal not lower)"
            )
    rr = get("unique", BASELINE)
    for policy in PREFIX_POLICIES:
        r = get("unique", policy)
        if rr is not None and r is not None:
            change = r.ttft(50) / rr.ttft(50) - 1
            # Nothing to share: routing must cost nothing visible. Faster is no miss.
            lines.append(
                f"- unique, {policy}: P50 TTFT {change * 100:+.1f}% vs round robin "
                f"({verdict(change <= 0.05)}, goal at most +5%)"
            )
    spill, nospill = get("hot-prefix", "prefix-spill"), get("hot-prefix", "prefix")
    if spill is not None and nospill is not None:
        limit = threshold if threshold is not None else spill.notes.get("concurrency_threshold")
        peak = spill.peak_in_flight
        against = (
            f"vs ConcurrencyThreshold {limit} ({verdict(peak <= int(limit))})"
            if limit is not None
            else "(no ConcurrencyThreshold)"
        )
        lines.append(
            f"- hot-prefix, with spill: peak in flight {peak} per instance {against}; P99 TTFT "
            f"{_ms(spill.ttft(99))} ms vs {_ms(nospill.ttft(99))} ms without spill "
            f"({verdict(spill.ttft(99) < nospill.ttft(99))})"
        )
    return lines


# -- capacity (bench/capacity.py) -------------------------------------------------------------

CurvePoint = tuple[float, float, float]
"""``(offered rate, TTFT P50 s, TTFT P99 s)`` of one run."""


def plot_capacity(
    curves: Mapping[str, Sequence[CurvePoint]],
    knees: Mapping[str, float | None],
    objective: tuple[float, float],
    path: Path,
    title: str,
) -> None:
    """TTFT P50 (dashed) and P99 (solid) against offered rate per policy, the objective's
    bounds in black, each policy's knee (its capacity) as a dotted vertical line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k, (policy, points) in enumerate(curves.items()):
        color = _COLORS.get(policy)
        ordered = sorted(points)
        xs = [p[0] for p in ordered]
        ax.plot(xs, [p[1] * 1000 for p in ordered], ls="--", marker=".", color=color, lw=1)
        ax.plot(
            xs,
            [p[2] * 1000 for p in ordered],
            ls="-",
            marker=".",
            color=color,
            lw=1.5,
            label=policy,
        )
        knee = knees.get(policy)
        if knee:
            ax.axvline(knee, ls=":", color=color, lw=1.2)
            ax.annotate(
                f"{knee:.3g}",
                (knee, objective[1] * 1000 * 1.6**k),
                color=color,
                fontsize=7,
                ha="right",
                va="bottom",
            )  # staggered: knees may be close
    p50, p99 = objective
    ax.axhline(p50 * 1000, color="black", ls="--", lw=0.8, label=f"objective P50 {p50:g} s")
    ax.axhline(p99 * 1000, color="black", ls="-", lw=0.8, label=f"objective P99 {p99:g} s")
    ax.set_yscale("log")
    ax.set_ylim(top=p99 * 1000 * 20)  # far past the knee TTFT grows without bound
    ax.set_xlabel("offered rate (requests/s, model time)")
    ax.set_ylabel("TTFT ms (P99 solid, P50 dashed)")
    ax.set_title(f"TTFT against offered rate: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_fleet_needs(
    needs: Mapping[str, Mapping[str, int | None]],
    path: Path,
    title: str,
    reference: int | None = None,
) -> None:
    """Instances each policy needs per workload (bars grouped by workload); a policy that
    needs more than the search's largest fleet has no bar."""
    plt = _pyplot()
    workloads = list(needs)
    policies = list(dict.fromkeys(p for per in needs.values() for p in per))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(workloads) + 2), 3.6))
    width = 0.8 / max(1, len(policies))
    for k, policy in enumerate(policies):
        xs = [j + k * width for j in range(len(workloads))]
        heights = [needs[w].get(policy) or 0 for w in workloads]
        bars = ax.bar(xs, heights, width, label=policy, color=_COLORS.get(policy))
        for bar, h in zip(bars, heights, strict=True):
            if h:
                ax.annotate(
                    str(h),
                    (bar.get_x() + bar.get_width() / 2, h),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    if reference:
        ax.axhline(reference, color="black", ls=":", lw=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
    ax.set_xticklabels(workloads, fontsize=7)
    ax.set_ylabel("instances needed")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=min(len(policies), 5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
