"""The Grafana dashboard (charts/kvoffload/files/dashboards/): valid JSON, queries only metrics
the sidecar declares (sidecar/kvoffload_sidecar/metrics.py), covers the pool metrics, has a hit
ratio panel."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "kvoffload" / "files" / "dashboards" / "kvoffload-sidecar.json"
SIDECAR_METRICS = REPO / "sidecar" / "kvoffload_sidecar" / "metrics.py"
METRIC = re.compile(r"\bkvoffload_[a-z0-9_]+")
# Series suffixes Prometheus clients append to a declared name (client_python adds `_total` to
# counters; histograms expose _bucket/_sum/_count).
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")
# What the dashboard must show (the list of sidecar metrics).
REQUIRED = {
    "kvoffload_pool_capacity_bytes",
    "kvoffload_pool_used_bytes",
    "kvoffload_pool_pinned_bytes",
    "kvoffload_lookup_blocks_total",
    "kvoffload_stored_blocks_total",
    "kvoffload_loaded_blocks_total",
    "kvoffload_evicted_blocks_total",
    "kvoffload_stored_bytes_total",
    "kvoffload_loaded_bytes_total",
    "kvoffload_rpc_duration_seconds_bucket",
}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return exprs


def _declared_metrics() -> set[str]:
    if not SIDECAR_METRICS.exists():
        pytest.skip("sidecar/kvoffload_sidecar/metrics.py not written yet")
    return set(re.findall(r"[\"'](kvoffload_[a-z0-9_]+)[\"']", SIDECAR_METRICS.read_text()))


def _is_declared(name: str, declared: set[str]) -> bool:
    return name in declared or any(
        name.endswith(s) and name[: -len(s)] in declared for s in SUFFIXES
    )


def test_dashboard_is_a_grafana_dashboard():
    dashboard = _dashboard()
    assert (dashboard["uid"], isinstance(dashboard["schemaVersion"], int)) == (
        "kvoffload-sidecar",
        True,
    )
    assert all(
        p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"]
    )


def test_panel_ids_are_unique_and_panels_do_not_overlap():
    panels = _dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [
        (p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy)
        for p in panels
        for dx in range(p["gridPos"]["w"])
        for dy in range(p["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells)) and all(x < 24 for x, _ in cells)


def test_every_queried_metric_is_declared_by_the_sidecar():
    declared = _declared_metrics()
    queried = {m for e in _exprs(_dashboard()) for m in METRIC.findall(e)}
    assert queried and not {m for m in queried if not _is_declared(m, declared)}


def test_dashboard_shows_every_pool_metric():
    queried = {m for e in _exprs(_dashboard()) for m in METRIC.findall(e)}
    assert queried >= REQUIRED


def test_dashboard_has_a_hit_ratio_panel():
    (panel,) = [p for p in _dashboard()["panels"] if p["title"] == "Lookup hit ratio"]
    (expr,) = [t["expr"] for t in panel["targets"]]
    numerator, _, denominator = expr.partition(" / ")
    assert 'result="hit"' in numerator and "result" not in denominator
    assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_queries_have_balanced_brackets_and_filter_by_the_dashboard_variables():
    for expr in (t["expr"] for p in _dashboard()["panels"] for t in p["targets"]):
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), expr
        for selector in re.findall(r"kvoffload_[a-z0-9_]+\{([^}]*)\}", expr):
            assert 'namespace=~"$namespace"' in selector and 'pod=~"$pod"' in selector, expr


def test_counters_are_queried_as_total_and_gauges_as_is():
    """Kind-aware check against the sidecar's metric table: client_python exposes a counter `x`
    only as `x_total`, a gauge only as `x`."""
    metrics = pytest.importorskip("kvoffload_sidecar.metrics")
    kinds = {m.name: m.kind for m in metrics.NAMESPACE_METRICS}
    queried = {m for e in _exprs(_dashboard()) for m in METRIC.findall(e)}
    wrong = {
        m
        for m in queried
        if (kinds.get(m) == "counter")
        or (m.endswith("_total") and kinds.get(m[: -len("_total")]) == "gauge")
    }
    assert kinds and not wrong


def test_pool_metrics_filter_by_the_pool_namespace_label():
    """The sidecar labels per-namespace series `pool_namespace` (a PodMonitor's `namespace` is the
    pod's Kubernetes namespace): every query of such a series filters by the dashboard variable
    of the same name, and nothing relies on Prometheus' `exported_namespace` rename."""
    metrics = pytest.importorskip("kvoffload_sidecar.metrics")
    label = metrics.NAMESPACE_LABEL
    assert label != "namespace"
    series = {
        m.name + ("_total" if m.kind == "counter" else "")
        for m in metrics.NAMESPACE_METRICS
        if m.labels[0] == label
    }
    dashboard = _dashboard()
    assert label in {v["name"] for v in dashboard["templating"]["list"]}
    filtered: set[str] = set()
    for expr in _exprs(dashboard):
        assert "exported_namespace" not in expr, expr
        for name, selector in re.findall(r"(kvoffload_[a-z0-9_]+)\{([^}]*)\}", expr):
            if name in series and "label_values" not in expr:
                assert f'{label}=~"${label}"' in selector, expr
                filtered.add(name)
    assert filtered and filtered >= REQUIRED & series
