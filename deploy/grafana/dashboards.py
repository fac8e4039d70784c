"""The Grafana dashboards, built from `panels.py` with grafana-foundation-sdk, and their
provisioning files (a Prometheus datasource and a dashboards folder).

    python -m dsv4_cluster.deploy.grafana          # rewrite deploy/grafana/{dashboards,provisioning}

The JSON under `dashboards/` is generated, never edited by hand: a test fails when it differs
from what this module builds. `dsv4-cluster monitor up` writes provisioning files with the real
Prometheus URL and dashboards folder of a running monitor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.builders.common import ReduceDataOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.gauge import Panel as GaugePanel
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as StatPanel
from grafana_foundation_sdk.builders.timeseries import Panel as TimeseriesPanel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from .panels import KV_CACHE_ROWS, OVERVIEW_ROWS, PanelSpec, RowSpec

HERE = Path(__file__).resolve().parent
DATASOURCE_UID = "dsv4-prometheus"
DATASOURCE_VAR = "datasource"
DEFAULT_PROMETHEUS_URL = "http://127.0.0.1:9090"
DEFAULT_DASHBOARDS_DIR = "/var/lib/grafana/dashboards/dsv4-cluster"
DASHBOARDS = {  # file name -> (uid, title, rows)
    "kv-cache.json": ("dsv4-kv-cache", "dsv4-cluster / KV cache", KV_CACHE_ROWS),
    "cluster-overview.json": ("dsv4-overview", "dsv4-cluster / overview", OVERVIEW_ROWS),
}
_REF_IDS = "ABCDEFGH"


def _panel(spec: PanelSpec, panel_id: int) -> Any:
    datasource = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
    if spec.kind == "timeseries":
        panel = TimeseriesPanel().fill_opacity(10)
    elif spec.kind == "stat":
        panel = StatPanel().reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
    elif spec.kind == "gauge":
        panel = GaugePanel().reduce_options(ReduceDataOptions().calcs(["lastNotNull"])).min(0).max(1)
    else:
        raise ValueError(f"panel {spec.title!r}: unknown kind {spec.kind!r}")
    panel = panel.id(panel_id).title(spec.title).unit(spec.unit).datasource(datasource)
    if spec.description:
        panel = panel.description(spec.description)
    for ref_id, query in zip(_REF_IDS, spec.queries, strict=False):
        panel = panel.with_target(Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref_id))
    return panel


def build(uid: str, title: str, rows: tuple[RowSpec, ...]) -> dict[str, Any]:
    """One dashboard as Grafana JSON (a dict)."""
    board = (Dashboard(title).uid(uid).tags(["dsv4-cluster", "generated"]).refresh("10s")
             .time("now-1h", "now").timezone("browser")
             .with_variable(DatasourceVariable(DATASOURCE_VAR).label("Prometheus").type("prometheus")))
    next_id = 1
    for row in rows:
        board = board.with_row(Row(row.title).id(next_id))
        next_id += 1
        for spec in row.panels:
            board = board.with_panel(_panel(spec, next_id))
            next_id += 1
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def dashboards() -> dict[str, dict[str, Any]]:
    """{file name: dashboard JSON} for every dashboard."""
    return {name: build(uid, title, rows) for name, (uid, title, rows) in DASHBOARDS.items()}


def provisioning(prometheus_url: str = DEFAULT_PROMETHEUS_URL,
                 dashboards_dir: str = DEFAULT_DASHBOARDS_DIR) -> dict[str, str]:
    """{relative path: YAML text} of Grafana's provisioning files for this datasource and folder."""
    datasource = {"apiVersion": 1, "datasources": [{
        "name": "dsv4-cluster Prometheus", "uid": DATASOURCE_UID, "type": "prometheus",
        "access": "proxy", "url": prometheus_url, "isDefault": True, "editable": False}]}
    provider = {"apiVersion": 1, "providers": [{
        "name": "dsv4-cluster", "folder": "dsv4-cluster", "type": "file", "disableDeletion": True,
        "allowUiUpdates": False, "updateIntervalSeconds": 30, "options": {"path": dashboards_dir}}]}
    return {"datasources/dsv4-cluster.yml": yaml.safe_dump(datasource, sort_keys=False),
            "dashboards/dsv4-cluster.yml": yaml.safe_dump(provider, sort_keys=False)}


def write_all(dashboards_dir: Path, provisioning_dir: Path, prometheus_url: str = DEFAULT_PROMETHEUS_URL,
              provisioned_dashboards_dir: str = DEFAULT_DASHBOARDS_DIR) -> list[Path]:
    """Write every dashboard and provisioning file; returns their paths."""
    written = []
    dashboards_dir.mkdir(parents=True, exist_ok=True)
    for name, board in dashboards().items():
        path = dashboards_dir / name
        path.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
        written.append(path)
    for rel, text in provisioning(prometheus_url, provisioned_dashboards_dir).items():
        path = provisioning_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel in a dashboard's JSON."""
    return [(p["title"], t["expr"]) for p in board["panels"] if p.get("type") != "row"
            for t in p.get("targets", [])]
