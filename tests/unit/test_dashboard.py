"""The Grafana dashboard and its provisioning: the JSON parses, its panels query the provisioned
data source, every metric name its queries use is defined in `stream_rl/` (found by reading the
code's metric definitions, not from a list kept by hand), and the trainer's step metrics it
selects by label are ones the trainer computes."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD: dict[str, Any] = json.loads((GRAFANA / "dashboards" / "stream-rl.json").read_text())
METRIC_RE = re.compile(r"\bstream_rl_[a-z0-9_]+\b")
KINDS = {
    "Counter": ("_total", "_created", ""),
    "CounterMetricFamily": ("_total", "_created", ""),
    "Gauge": ("",),
    "GaugeMetricFamily": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "HistogramMetricFamily": ("_bucket", "_sum", "_count"),
    "Summary": ("", "_sum", "_count", "_created"),
}


def _string(node: ast.expr, constants: dict[str, str]) -> str | None:
    """A str literal, or an f-string made of literals and module-level str constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            elif (
                isinstance(v, ast.FormattedValue)
                and isinstance(v.value, ast.Name)
                and v.value.id in constants
            ):
                parts.append(constants[v.value.id])
            else:
                return None
        return "".join(parts)
    return None


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def exported_metric_names() -> set[str]:
    """Every series name the code defines: `Counter("name", ...)`-style calls of prometheus_client's
    metric classes and metric families (also when the class is passed in, as in
    `_gauge(Gauge, "name", ...)`), with the suffixes prometheus_client adds to each kind."""
    names: set[str] = set()
    for path in (REPO / "stream_rl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        constants = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            kind, args = _name(call.func), call.args
            if kind not in KINDS and args and _name(args[0]) in KINDS:
                kind, args = _name(args[0]), args[1:]
            if kind not in KINDS or not args:
                continue
            name = _string(args[0], constants)
            if name is None or not name.startswith("stream_rl_"):
                continue
            base = name.removesuffix("_total")
            names.update(base + suffix for suffix in KINDS[kind])
    return names


def queries() -> list[str]:
    out = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    return out


def test_the_scan_finds_the_code_s_metrics() -> None:
    names = exported_metric_names()
    # One of each way the code defines metrics: a module-level Counter, a Histogram, an f-string
    # family of the inference server, and the lag gauges created through a helper.
    assert {"stream_rl_records_out_total", "stream_rl_trainer_version_lag_bucket"} <= names
    assert {"stream_rl_inference_tokens_per_second", "stream_rl_consumer_lag"} <= names
    assert "stream_rl_no_such_metric" not in names


def test_dashboard_parses_and_queries_the_provisioned_datasource() -> None:
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    panels = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
    assert panels and DASHBOARD["uid"] == "stream-rl"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == ds["uid"]
        assert all(t["datasource"]["uid"] == ds["uid"] and t["expr"].strip() for t in p["targets"])
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_provider_loads_the_dashboards_where_compose_mounts_them() -> None:
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "stream-rl.yml").read_text())
    (prov,) = provider["providers"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == prov["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = exported_metric_names()
    used = {m for q in queries() for m in METRIC_RE.findall(q)}
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics nothing in stream_rl/ exports: {missing}"
    # The figures the dashboard exists for.
    assert {
        "stream_rl_trainer_step",
        "stream_rl_trainer_version_lag_bucket",
        "stream_rl_consumer_lag",
        "stream_rl_consumer_oldest_record_age_seconds",
        "stream_rl_records_out_total",
        "stream_rl_inference_tokens_per_second",
        "stream_rl_inference_running",
        "stream_rl_inference_waiting",
        "stream_rl_inference_weight_update_receive_seconds_bucket",
        "stream_rl_inference_weight_update_stall_seconds_bucket",
    } <= used


def test_trainer_step_metrics_it_selects_are_computed_by_the_trainer() -> None:
    """`stream_rl_trainer_step{metric="x"}`: x must be a key the trainer puts in a step's metrics."""
    sources = [REPO / "stream_rl" / "stages" / "trainer.py", REPO / "stream_rl" / "rl" / "stats.py"]
    sources += list((REPO / "stream_rl" / "train").glob("*.py"))
    code = "\n".join(p.read_text() for p in sources)
    selected = {m for q in queries() for m in re.findall(r'stream_rl_trainer_step\{metric="([a-z_]+)"', q)}
    assert {"reward_mean", "version_lag_mean", "broadcast_ms"} <= selected
    for key in selected:
        assert re.search(rf'["\']{key}["\']|\b{key}=', code), f"the trainer computes no step metric {key!r}"
