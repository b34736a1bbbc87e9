"""``prefix-router bench``: compare routing policies on the same workload.

    prefix-router bench run    --workload rag --policies all --time-scale 2 --out DIR
    prefix-router bench des    --workload rag --instances 128 --resize 600:+32,1200:-32
    prefix-router bench drive  --url http://router:8080 --instance http://vllm-1:8000 ...
    prefix-router bench report DIR
    prefix-router bench capacity --workload rag --instances 8 --out bench/results/capacity

``run`` starts, per policy, fresh simulated instances and the real stack in front of them
(:mod:`.live`); ``des`` runs the same workload and routing code in virtual time
(:mod:`.des`); ``drive`` measures an already running router and fleet (real vLLM too);
``report`` rebuilds the markdown and PNGs from the saved JSON results; ``capacity`` finds, in the
simulation, each policy's highest rate within a TTFT objective and the fleet each needs for
one load (:mod:`.capacity`). Results go to
``--out`` as ``<workload>/<mode>-<policy>.json`` plus ``report.md`` and PNGs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.des import DesSettings, parse_resizes, simulate
from bench.policies import Policy, parse_policies
from bench.report import (
    agreement_table,
    check_goals,
    headline_table,
    table,
    write_plots,
)
from bench.results import RequestRecord, RunResult
from bench.spec import Workload
from bench.trace import TraceOptions, load_trace
from bench.workloads import WORKLOADS, describe, generate, make_params
from prefix_router.core.config import RouterConfig
from vllm_sim.config import EngineConfig, make_config


def _workload_choice_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload", default="system-prompt", help=f"comma-separated: {', '.join(WORKLOADS)}"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="workload parameter (repeatable), e.g. --set docs=96",
    )


def _workload_args(p: argparse.ArgumentParser) -> None:
    _workload_choice_args(p)
    p.add_argument("--requests", type=int, help="requests per run (workload parameter)")
    p.add_argument("--rate", type=float, help="arrivals per model-second (workload parameter)")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument("--trace", help="replay this JSONL trace instead of a generated workload")
    p.add_argument("--block-tokens", type=int, default=512, help="trace: tokens per hash id")
    p.add_argument("--speedup", type=float, default=1.0, help="trace: compress time by this")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default="all", help="comma-separated policies, or all")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--profile", default="llama-3.1-70b-8xh100", help="simulator profile")
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks per instance (profile's)")
    p.add_argument(
        "--concurrency-threshold",
        type=int,
        help="router ConcurrencyThreshold (default: the router's default)",
    )
    p.add_argument(
        "--prefill-tokens-per-s", type=float, help="simulated instances' prefill rate (profile's)"
    )
    p.add_argument("--entries-per-weight", type=int, help="ring entries per instance weight")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-router bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="live: the real stack over simulated instances")
    _workload_args(run)
    _fleet_args(run)
    run.add_argument("--time-scale", type=float, default=1.0, help="simulator speed-up")
    run.add_argument("--sim-procs", type=int, default=1, help="simulator processes")
    run.add_argument("--ext-procs", type=int, default=2)
    run.add_argument("--max-duration", type=float, default=1800.0, help="wall s per policy")
    run.add_argument("--work-dir", type=Path, help="keep logs and rendered configs here")
    des = sub.add_parser("des", help="discrete-event simulation of the same fleet")
    _workload_args(des)
    _fleet_args(des)
    des.add_argument("--resize", default="", help="TIME:+N / TIME:-N events, comma-separated")
    des.add_argument("--window", type=float, default=30.0, help="hit-rate window (s)")
    drive = sub.add_parser("drive", help="measure a running router and fleet")
    _workload_args(drive)
    drive.add_argument("--url", required=True, help="the router's base URL")
    drive.add_argument(
        "--instance",
        action="append",
        default=[],
        required=True,
        help="an instance's base URL, for /metrics (repeatable)",
    )
    drive.add_argument("--model", help="model name (default: the first instance's)")
    drive.add_argument("--policy", default="unknown", help="label of what is measured")
    drive.add_argument("--time-scale", type=float, default=1.0)
    drive.add_argument("--max-duration", type=float, default=1800.0)
    report = sub.add_parser("report", help="rebuild report.md and PNGs from saved results")
    report.add_argument("folder", type=Path)
    _capacity_args(
        sub.add_parser("capacity", help="highest rate within a TTFT objective, fleet needed (DES)")
    )
    return parser


def _capacity_args(p: argparse.ArgumentParser) -> None:
    _workload_choice_args(p)
    p.add_argument("--out", type=Path, default=Path("bench/results/capacity"))
    _fleet_args(p)
    p.set_defaults(instances=8, policies="all", requests=None, rate=None, seed=None)
    g = p.add_argument_group("objective")
    g.add_argument("--p50", type=float, default=0.5, help="P50 TTFT bound (s)")
    g.add_argument("--p99", type=float, default=2.0, help="P99 TTFT bound (s)")
    g.add_argument("--max-errors", type=int, default=0)
    g.add_argument(
        "--min-served",
        type=float,
        default=0.9,
        help="requests completed in the window per second, at least this fraction of the "
        "offered rate (the fleet keeps up; 0: not checked)",
    )
    g = p.add_argument_group("each run")
    g.add_argument("--run-requests", type=int, default=2000, help="at least this many")
    g.add_argument(
        "--min-duration",
        type=float,
        default=0.0,
        help="and at least this many model seconds of new arrivals",
    )
    g.add_argument(
        "--warmup", type=float, default=0.25, help="fraction of the arrivals' span not measured"
    )
    g = p.add_argument_group("search")
    g.add_argument(
        "--start", default="10", help="first rate tried (req/s), or per policy: 30,prefix=120,..."
    )
    g.add_argument("--seeds", type=int, default=3, help="seeds 1..N; a rate passes on all")
    g.add_argument("--factor", type=float, default=1.4, help="bracketing step")
    g.add_argument("--precision", type=float, default=0.05, help="relative, hi/lo - 1")
    g.add_argument(
        "--min-rate",
        type=float,
        default=1.0,
        help="below it a policy reads as not meeting the objective at all",
    )
    g.add_argument("--max-rate", type=float, default=2000.0)
    g = p.add_argument_group("instances saved")
    g.add_argument(
        "--fleet-load",
        type=float,
        help="offered rate (default: round robin's capacity); 0 skips the search",
    )
    g.add_argument(
        "--fleet-policies", default="", help="the policies searched (default: every policy swept)"
    )
    g.add_argument("--fleet-min", type=int, default=4)
    g.add_argument("--fleet-max", type=int, default=64)
    p.add_argument("--jobs", type=int, default=1, help="processes (policies in parallel)")


def _overrides(args: argparse.Namespace) -> dict[str, str | int | float]:
    out: dict[str, str | int | float] = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE")
        out[name.strip()] = value.strip()
    for name in ("requests", "rate", "seed"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


def _workloads(args: argparse.Namespace) -> list[tuple[Workload, str]]:
    if args.trace:
        options = TraceOptions(
            block_tokens=args.block_tokens, speedup=args.speedup, max_requests=args.requests
        )
        return [(load_trace(args.trace, options), f"trace={args.trace}, {options}")]
    out = []
    for name in filter(None, (n.strip() for n in args.workload.split(","))):
        overrides = _overrides(args)
        out.append((generate(name, overrides), describe(make_params(name, overrides))))
    return out


def _router(args: argparse.Namespace) -> RouterConfig:
    changes: dict[str, object] = {}
    if args.concurrency_threshold is not None:
        changes["concurrency_threshold"] = args.concurrency_threshold
    if args.entries_per_weight:
        changes["ring"] = {"entries_per_weight": args.entries_per_weight}
    return RouterConfig().patched(changes)


def _progress(total: int, label: str) -> tuple[Callable[[RequestRecord], None], Callable[[], None]]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    bars: list[Any] = []  # created at the first request, so start-up is not in its rate

    def tick(record: RequestRecord) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc=label, unit="req", mininterval=1.0, file=sys.stderr))
        bars[0].update(1)
        if record.error is not None:
            bars[0].set_postfix_str(f"last error: {record.error[:40]}", refresh=False)

    def close() -> None:
        if bars:
            bars[0].close()

    return tick, close


def _counter(tick: Callable[[RequestRecord], None]) -> Callable[[int], None]:
    """Adapts a per-record progress tick to a "requests done so far" callback."""
    last = [0]
    blank = RequestRecord(0.0, None, None, None)

    def advance(done: int) -> None:
        for _ in range(done - last[0]):
            tick(blank)
        last[0] = done

    return advance


def _folder(out: Path, workload: Workload) -> Path:
    return out / workload.name.replace(":", "-").replace("/", "-")


def _notes(result: RunResult, params: str, args: argparse.Namespace) -> None:
    result.params = params
    result.notes.update(
        {
            "instances": args.instances if hasattr(args, "instances") else len(result.instances),
            "concurrency_threshold": getattr(args, "concurrency_threshold", None),
            "num_gpu_blocks": getattr(args, "num_gpu_blocks", None),
            "profile": getattr(args, "profile", None),
        }
    )


def _run(args: argparse.Namespace) -> int:
    from bench.live import LiveSettings, run_live

    sim_args: tuple[str, ...] = ()
    if args.num_gpu_blocks:
        sim_args = ("--num-gpu-blocks", str(args.num_gpu_blocks))
    if args.prefill_tokens_per_s:  # as `des` takes it, so both run the same instances
        sim_args += ("--prefill-tokens-per-s", str(args.prefill_tokens_per_s))
    settings = LiveSettings(
        router=_router(args),
        instances=args.instances,
        sim_profile=args.profile,
        sim_args=sim_args,
        sim_procs=args.sim_procs,
        time_scale=args.time_scale,
        ext_procs=args.ext_procs,
        max_duration_s=args.max_duration,
        work_dir=args.work_dir,
    )
    for workload, params in _workloads(args):
        folder = _folder(args.out, workload)
        for policy in parse_policies(args.policies):
            tick, close = _progress(workload.num_requests, f"{workload.name} {policy.value}")
            try:
                result = run_live(workload, policy, settings, on_done=tick)
            finally:
                close()
            _notes(result, params, args)
            result.save(folder / f"live-{policy.value}.json")
            print(_summary(result), file=sys.stderr)
    write_report(args.out)
    return 0


def _engine(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, float] = {}
    if args.num_gpu_blocks:
        overrides["num_gpu_blocks"] = args.num_gpu_blocks
    if args.prefill_tokens_per_s:
        overrides["prefill_tokens_per_s"] = args.prefill_tokens_per_s
    return make_config(args.profile, **overrides)


def _des(args: argparse.Namespace) -> int:
    engine = _engine(args)
    for workload, params in _workloads(args):
        folder = _folder(args.out, workload)
        for policy in parse_policies(args.policies):
            settings = DesSettings(
                policy=policy,
                engine=engine,
                router=_router(args),
                instances=args.instances,
                resizes=parse_resizes(args.resize),
                window_s=args.window,
            )
            tick, close = _progress(workload.num_requests, f"des {workload.name} {policy.value}")
            try:
                result = simulate(workload, settings, progress=_counter(tick))
            finally:
                close()
            _notes(result, params, args)
            result.save(folder / f"des-{policy.value}.json")
            print(_summary(result), file=sys.stderr)
    write_report(args.out)
    return 0


def _capacity(args: argparse.Namespace) -> int:
    from bench import capacity

    objective = capacity.Objective(
        p50_s=args.p50, p99_s=args.p99, max_errors=args.max_errors, min_served=args.min_served
    )
    plan = capacity.RunPlan(
        requests=args.run_requests, min_duration_s=args.min_duration, warmup=args.warmup
    )
    starts = capacity.parse_starts(args.start)
    search = capacity.SearchSettings(
        start=starts[""],
        seeds=tuple(range(1, args.seeds + 1)),
        factor=args.factor,
        precision=args.precision,
        min_rate=args.min_rate,
        max_rate=args.max_rate,
    )
    fleet = (
        None
        if args.fleet_load == 0
        else capacity.FleetSettings(
            load=args.fleet_load,
            lo=args.fleet_min,
            hi=args.fleet_max,
            policies=tuple(p.strip() for p in args.fleet_policies.split(",") if p.strip()),
        )
    )
    engine = _engine(args)
    fleet_text = (
        f"{args.instances} instances of {args.profile}, "
        f"{engine.num_gpu_blocks:,} KV blocks of {engine.block_size} tokens, "
        f"prefill {engine.cost.prefill_tokens_per_s:,.0f} tokens/s"
    )
    overrides = _overrides(args)
    for name in filter(None, (n.strip() for n in args.workload.split(","))):
        print(f"capacity {name}: {objective}; {fleet_text}", file=sys.stderr)
        params = capacity.describe_fixed(make_params(name, overrides))
        result = capacity.sweep(
            name,
            overrides,
            policies=capacity.parse_policies(args.policies),
            engine=engine,
            router=_router(args),
            instances=args.instances,
            plan=plan,
            objective=objective,
            search=search,
            starts=starts,
            fleet=fleet,
            jobs=args.jobs,
            params=params,
            fleet_text=fleet_text,
            previous=capacity.load_one(args.out, name),
        )
        previous = capacity.load_one(args.out, name)
        if previous is not None and capacity.same_settings(previous, result):
            result = capacity.merge(previous, result)  # keep the policies not rerun
        print(capacity.summary(result), file=sys.stderr)
        capacity.save(result, args.out)
    print(capacity.write_report(args.out))
    return 0


def _drive(args: argparse.Namespace) -> int:
    from bench.driver import DriverSettings
    from bench.live import measure, model_of

    for workload, params in _workloads(args):
        driver = DriverSettings(
            base_url=args.url.rstrip("/"),
            model=args.model or model_of(args.instance[0]),
            time_scale=args.time_scale,
            max_duration_s=args.max_duration,
        )
        tick, close = _progress(workload.num_requests, f"{workload.name} {args.policy}")
        try:
            result = measure(workload, args.policy, driver, args.instance, on_done=tick)
        finally:
            close()
        _notes(result, params, args)
        result.save(_folder(args.out, workload) / f"live-{args.policy}.json")
        print(_summary(result), file=sys.stderr)
    write_report(args.out)
    return 0


def _summary(r: RunResult) -> str:
    return (
        f"{r.mode} {r.workload} {r.policy}: hit rate {r.hit_rate:.1%}, TTFT P50 "
        f"{r.ttft(50) * 1000:.0f} ms P99 {r.ttft(99) * 1000:.0f} ms, "
        f"{r.throughput_rps:.2f} req/s, peak in flight {r.peak_in_flight}, "
        f"errors {r.errors}"
    )


_ORDER = {p.value: i for i, p in enumerate(Policy)}


def load_results(folder: Path) -> dict[tuple[str, str], list[RunResult]]:
    """Saved results under ``folder``: ``(workload, mode) -> results in policy order``."""
    grouped: dict[tuple[str, str], list[RunResult]] = {}
    for path in sorted(folder.glob("*/*.json")):
        result = RunResult.load(path)
        grouped.setdefault((result.workload, result.mode), []).append(result)
    for results in grouped.values():
        results.sort(key=lambda r: _ORDER.get(r.policy, 99))
    return grouped


def write_report(folder: Path) -> Path:
    """``report.md`` and PNGs for every saved result under ``folder``."""
    grouped = load_results(folder)
    lines = [
        "# Benchmark results",
        "",
        "Times are model seconds (simulated seconds on the simulator). "
        "Generated by `prefix-router bench`; see bench/README.md.",
        "",
    ]
    for mode in ("live", "des"):
        by_workload = {
            w: rs for (w, m), rs in sorted(grouped.items(), key=_workload_order) if m == mode
        }
        if not by_workload:
            continue
        lines += [f"## {mode}", "", headline_table(by_workload), ""]
        for workload, results in by_workload.items():
            stem = f"{mode}-{workload.replace(':', '-').replace('/', '-')}"
            first = results[0]
            size = first.notes.get("instances", len(first.instances))
            resizes = "".join(f"; at {at:g} s {what}" for at, what in first.events)
            lines += [
                f"### {workload} ({mode})",
                "",
                f"Workload: {first.params}. Fleet: {size} instances{resizes}; "
                f"{_describe_notes(first)}.",
                "",
                table(results),
                "",
            ]
            for path in write_plots(results, folder / "plots", stem, f"{workload} ({mode})"):
                lines.append(f"![{path.stem}](plots/{path.name})")
            lines.append("")
        goals = check_goals(by_workload)
        if goals:
            lines += [f"### Goals ({mode})", "", *goals, ""]
    pairs = [
        (w, grouped[(w, "live")], grouped[(w, "des")])
        for (w, m), _ in sorted(grouped.items(), key=_workload_order)
        if m == "live" and (w, "des") in grouped
    ]
    if pairs:
        lines += ["## DES vs live (same workload, same ring, same instance model)", ""]
        for workload, live, des in pairs:
            lines += [f"### {workload}", "", agreement_table(live, des), ""]
    out = folder / "report.md"
    out.write_text("\n".join(lines))
    return out


_WORKLOAD_ORDER = ("system-prompt", "rag", "unique", "chat", "code", "hot-prefix")


def _workload_order(item: tuple[tuple[str, str], list[RunResult]]) -> tuple[int, str]:
    name = item[0][0]
    return (_WORKLOAD_ORDER.index(name) if name in _WORKLOAD_ORDER else 99, name)


def _describe_notes(result: RunResult) -> str:
    notes = result.notes
    parts = [
        f"{k.replace('_', ' ')} {v}"
        for k, v in notes.items()
        if k in ("profile", "num_gpu_blocks", "concurrency_threshold") and v is not None
    ]
    if result.mode == "live":
        parts.append(f"time scale {result.time_scale:g}")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "des":
            return _des(args)
        if args.command == "drive":
            return _drive(args)
        if args.command == "capacity":
            return _capacity(args)
        print(write_report(args.folder))
        return 0
    except ValueError as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
