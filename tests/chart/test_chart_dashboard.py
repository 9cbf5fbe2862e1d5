"""The Grafana dashboard (charts/kvoffload/files/dashboards/): valid JSON, queries only series
listed in docs/METRICS.md (which tests/sidecar/test_metrics_exposition.py ties to a real
sidecar's /metrics), covers the pool, latency and capacity metrics, has hit ratio panels."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.sidecar.metrics_doc import series_names, sidecar_documented

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "kvoffload" / "files" / "dashboards" / "kvoffload-sidecar.json"
METRIC = re.compile(r"\bkvoffload_[a-z0-9_]+")
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
    "kvoffload_lookup_queried_blocks_total",
    "kvoffload_pool_usage_perc",
    "kvoffload_store_latency_seconds_bucket",
    "kvoffload_load_latency_seconds_bucket",
    "kvoffload_kv_capacity_tokens",
    "kvoffload_kv_effective_capacity_tokens",
}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return exprs


def _documented_series() -> set[str]:
    """Every sample name a query may use: the sidecar's documented series (histograms: their
    _bucket/_sum/_count)."""
    return {s for d in sidecar_documented().values() for s in series_names(d.name, d.type)}


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


def test_every_queried_metric_is_a_documented_sidecar_series():
    """Exact names: a counter queried without `_total` or a histogram without `_bucket` fails."""
    queried = {m for e in _exprs(_dashboard()) for m in METRIC.findall(e)}
    assert queried and queried - _documented_series() == set()


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
    filtered = _filtered_by(label)
    assert filtered >= REQUIRED & _labelled(label)
    assert "kvoffload_store_latency_seconds_bucket" in filtered


def test_capacity_metrics_filter_by_the_model_variable():
    """The effective-capacity series are per served model: the dashboard's `model` variable."""
    assert _filtered_by("model") >= {
        "kvoffload_kv_capacity_tokens",
        "kvoffload_kv_effective_capacity_tokens",
    }


def _labelled(label: str) -> set[str]:
    """Documented sidecar sample names whose series carry `label`."""
    return {
        s
        for d in sidecar_documented().values()
        if label in d.labels
        for s in series_names(d.name, d.type)
    }


def _filtered_by(label: str) -> set[str]:
    """Names of the queried series that carry `label`, after checking that every query of them
    filters by the dashboard variable of that name (label_values queries aside)."""
    dashboard = _dashboard()
    assert label in {v["name"] for v in dashboard["templating"]["list"]}
    series = _labelled(label)
    filtered: set[str] = set()
    for expr in _exprs(dashboard):
        assert "exported_namespace" not in expr, expr
        for name, selector in re.findall(r"(kvoffload_[a-z0-9_]+)\{([^}]*)\}", expr):
            if name in series and "label_values" not in expr:
                assert f'{label}=~"${label}"' in selector, expr
                filtered.add(name)
    assert filtered
    return filtered
