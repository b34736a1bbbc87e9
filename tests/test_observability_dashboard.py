"""The Grafana dashboard and docs/observability.md name only metrics that exist.

Our metric names come from the code (ext_proc's registry, the control plane's declared
families); Envoy's from the table in the docs, which the e2e test checks against a live Envoy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from control_plane.metrics import METRIC_NAMES, PREFIX
from ext_proc.metrics import PrometheusCallbacks

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "compose" / "grafana" / "dashboards" / "prefix-router.json"
DOCS = REPO / "docs" / "observability.md"
NAME = re.compile(r"\b((?:prefix_router|envoy)_[a-zA-Z0-9_]+)\b")
LABELS = re.compile(r"\{[^}]*\}|\b(?:by|without|on|ignoring)\s*\([^)]*\)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(text: str) -> list[str]:
    """Metric names in PromQL or prose: label matchers and grouping labels left out."""
    return NAME.findall(LABELS.sub(" ", text))


def ext_proc_metrics() -> dict[str, str]:
    """Exposed name (counters with ``_total``) -> type, from a live registry."""
    names = {}
    callbacks = PrometheusCallbacks()
    callbacks.watch_store(lambda: (0, 0))  # registered when ext_proc runs with Redis
    for family in callbacks.registry.collect():
        suffix = "_total" if family.type == "counter" else ""
        names[family.name + suffix] = family.type
    return names


def control_plane_metrics() -> set[str]:
    return {PREFIX + name for name in METRIC_NAMES}


def doc_table(marker: str) -> list[list[str]]:
    """Rows of the table between ``<!-- marker:begin -->`` and ``<!-- marker:end -->``."""
    text = DOCS.read_text()
    body = text.split(f"<!-- {marker}:begin -->")[1].split(f"<!-- {marker}:end -->")[0]
    rows = [line for line in body.strip().splitlines() if line.startswith("|")][2:]
    return [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]


def envoy_prometheus_names() -> set[str]:
    return {row[1].split("{")[0] for row in doc_table("envoy-stats")}


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def exprs() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def test_every_dashboard_query_names_an_exported_metric() -> None:
    ours = set(ext_proc_metrics()) | control_plane_metrics()
    envoy = envoy_prometheus_names()
    used = set()
    for title, expr in exprs():
        names = metric_names(expr)
        assert names, (title, expr)
        for name in names:
            if name.startswith("envoy_"):
                assert name in envoy, f"panel {title!r}: {name} is not a documented Envoy stat"
                continue
            base = name
            if base not in ours:
                base = next(
                    (
                        base.removesuffix(s)
                        for s in HISTOGRAM_SUFFIXES
                        if base.endswith(s) and base.removesuffix(s) in ours
                    ),
                    base,
                )
            assert base in ours, f"panel {title!r} queries {name}, which nothing exports"
            used.add(base)
    assert "prefix_router_ext_proc_decisions_total" in used


@pytest.mark.parametrize(
    ("words", "metrics"),
    [
        (("hit rate",), {"prefix_router_control_plane_fleet_prefix_cache_hit_ratio"}),
        (("hit rate", "per instance"), {"prefix_router_control_plane_prefix_cache_hits_total"}),
        (("ttft", "p50"), {"prefix_router_control_plane_fleet_time_to_first_token_seconds"}),
        (("decisions", "outcome"), {"prefix_router_ext_proc_decisions_total"}),
        (
            ("in flight", "spill limit"),
            {"prefix_router_control_plane_in_flight", "prefix_router_control_plane_spill_limit"},
        ),
        (
            # the threshold bounds requests waiting for their first token, not in flight
            ("waiting", "concurrencythreshold"),
            {
                "prefix_router_control_plane_requests_waiting",
                "prefix_router_control_plane_concurrency_threshold",
            },
        ),
        (
            ("predicted affinity", "hit rate"),
            {
                "prefix_router_control_plane_decisions_total",
                "prefix_router_control_plane_prefix_cache_hits_total",
            },
        ),
    ],
)
def test_the_panels_operators_asked_for_are_there(
    words: tuple[str, ...], metrics: set[str]
) -> None:
    panels = [p for p in dashboard()["panels"] if all(w in p["title"].lower() for w in words)]
    assert panels, f"no panel titled with {words}"
    queried = {n for p in panels for t in p["targets"] for n in metric_names(t["expr"])}
    assert metrics <= queried


def test_dashboard_is_well_formed() -> None:
    dash = dashboard()
    assert dash["uid"] == "prefix-router" and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_docs_list_every_metric_and_only_those() -> None:
    cp_rows = doc_table("control-plane-metrics")
    assert {r[0] for r in cp_rows} == control_plane_metrics()
    for name, kind, *_ in cp_rows:
        assert METRIC_NAMES[name.removeprefix(PREFIX)] == kind, name
    ext_rows = doc_table("ext-proc-metrics")
    assert {r[0]: r[1] for r in ext_rows} == ext_proc_metrics()
    documented = {r[0] for r in cp_rows + ext_rows} | envoy_prometheus_names()
    for name in set(metric_names(DOCS.read_text())):
        if name.endswith("_"):  # a prefix named in prose
            continue
        base = name
        for suffix in HISTOGRAM_SUFFIXES:
            if base.endswith(suffix) and base.removesuffix(suffix) in documented:
                base = base.removesuffix(suffix)
        assert base in documented, f"docs mention {name}, which is in no table"
