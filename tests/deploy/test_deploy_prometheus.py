"""The Prometheus side without a cluster: the generated config and the alert rules pass promtool,
the rules' unit tests pass, and the file_sd targets follow what the controller starts and stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv4_cluster.deploy import path as deploy_path
from dsv4_cluster.orchestrator.supervise.controller import ClusterSpec
from dsv4_cluster.orchestrator.launch.plan import cluster_plans
from dsv4_cluster.orchestrator.monitor.prometheus_config import rules_path, write_config
from dsv4_cluster.orchestrator.monitor.stack import MonitorError, _spawn, _wait_ok
from dsv4_cluster.core import Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.monitor.targets import listed, record_targets, targets_dir
from dsv4_cluster.orchestrator.topology.load import load_topology

from bench.local_cluster import write_topology
from tests.deploy_tools import require_tool
from tests.prometheus_api import known_metric_names, metric_names_in


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_rules_pass_check_and_their_unit_tests() -> None:
    check = _promtool("check", "rules", str(rules_path()))
    assert check.returncode == 0 and "SUCCESS: 9 rules found" in check.stdout, check.stdout + check.stderr
    tests = _promtool("test", "rules", "alerts_test.yml", cwd=deploy_path("prometheus"))
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


def test_every_alert_has_a_unit_test_and_known_metric_names() -> None:
    rules = yaml.safe_load(rules_path().read_text())["groups"][0]["rules"]
    cases = yaml.safe_load(deploy_path("prometheus", "alerts_test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert {r["alert"] for r in rules} == tested  # each alert is shown firing at least once
    known = known_metric_names()
    for rule in rules:
        for name in metric_names_in(rule["expr"]):
            assert name in known, f"{rule['alert']}: {name} is not in metric_names"


def test_generated_config_passes_promtool(tmp_path: Path) -> None:
    cluster = write_topology(tmp_path)
    topology = load_topology(cluster.topology)
    config = write_config(topology)
    check = _promtool("check", "config", str(config))
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    data = yaml.safe_load(config.read_text())
    assert [j["job_name"] for j in data["scrape_configs"]] == ["dsv4-router", "dsv4-workers", "dsv4-orchestrator"]
    assert data["rule_files"] == [str(rules_path())]
    for name in ("router.json", "workers.json", "orchestrator.json"):  # empty until `up` fills them
        assert json.loads((targets_dir(topology.run_dir_path) / name).read_text()) == []


def test_targets_follow_the_processes(tmp_path: Path) -> None:
    cluster = write_topology(tmp_path)
    topology = load_topology(cluster.topology)
    workers, router = cluster_plans(topology)
    spec = ClusterSpec(namespace="t", endpoint="e", workers=tuple(workers), router=router,
                       node_addresses=(("local", "127.0.0.1"),))
    tdir = targets_dir(topology.run_dir_path)
    assert listed(topology.run_dir_path) == set()   # no files yet
    record_targets(spec, ())  # up: every process, whatever state it comes to (a FAILED one's alert must fire)
    workers_file = json.loads((tdir / "workers.json").read_text())
    assert workers_file == [
        {"targets": [f"127.0.0.1:{cluster.ports['prefill']}"],
         "labels": {"worker": "prefill-0", "role": "prefill", "node": "local"}},
        {"targets": [f"127.0.0.1:{cluster.ports['decode']}"],
         "labels": {"worker": "decode-0", "role": "decode", "node": "local"}}]
    assert json.loads((tdir / "router.json").read_text()) == [
        {"targets": [f"127.0.0.1:{cluster.ports['router']}"],
         "labels": {"worker": "router", "role": "router", "node": "local"}}]
    assert listed(topology.run_dir_path) == {"prefill-0", "decode-0", "router"}
    record_targets(spec, {"decode-0"})  # drained / stopped on purpose: gone
    assert [e["labels"]["worker"] for e in json.loads((tdir / "workers.json").read_text())] == ["prefill-0"]
    assert listed(topology.run_dir_path) == {"prefill-0", "router"}   # what a restarted controller reads back
    record_targets(spec, {"prefill-0", "decode-0", "router"})  # down
    assert json.loads((tdir / "workers.json").read_text()) == []
    assert json.loads((tdir / "router.json").read_text()) == []


def test_exporter_reports_each_state_and_restarts() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from dsv4_cluster.orchestrator.monitor.exporter import families

    class Rows:
        def __init__(self, rows: list[WorkerStatus] | None) -> None:
            self.rows = rows

        def collect(self):  # type: ignore[no-untyped-def]
            return families(self.rows)

    def exposition(rows: list[WorkerStatus] | None) -> str:
        registry = CollectorRegistry()
        registry.register(Rows(rows))
        return generate_latest(registry).decode()

    text = exposition([
        WorkerStatus("decode-0", Role.DECODE, "local", WorkerState.FAILED, None, 1, 4, None, "/x.log"),
        WorkerStatus("router", Role.ROUTER, "local", None, None, 2, 0, None, "/r.log",
                     error="supervisor unreachable"),  # no state: no series
    ])
    assert "dsv4_cluster_controller_up 1.0" in text
    assert 'dsv4_cluster_worker_state{node="local",role="decode",state="FAILED",worker="decode-0"} 1.0' in text
    assert 'dsv4_cluster_worker_state{node="local",role="decode",state="READY",worker="decode-0"} 0.0' in text
    assert 'dsv4_cluster_worker_restarts_total{node="local",role="decode",worker="decode-0"} 4.0' in text
    assert 'worker="router"' not in text
    down = exposition(None)
    assert "dsv4_cluster_controller_up 0.0" in down and "dsv4_cluster_worker_state{" not in down


def test_worker_metric_names_are_sglangs_own() -> None:
    """metric_names' worker names are SGLang 0.5.23's, read from its metrics collector's source."""
    import importlib.util

    import pytest

    from dsv4_cluster import metric_names as m

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23 to run this check)")
    source = (Path(spec.origin).parent / "srt" / "observability" / "metrics_collector.py").read_text()
    for name in (*m.WORKER_GAUGES, *m.WORKER_COUNTERS, *m.WORKER_HISTOGRAMS):
        assert f'name="{name}"' in source, f"SGLang 0.5.23 exports no {name}"


def test_monitor_up_refuses_a_busy_port_and_starts_nothing(tmp_path: Path) -> None:
    import socket

    from bench.local_cluster import run_cli

    require_tool("prometheus")
    cluster = write_topology(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_cli(cluster.home, "monitor", "up", str(cluster.topology), "--port", str(port), timeout=60)
    assert out.returncode == 1 and f"127.0.0.1:{port} is in use; pass a free --port" in out.stderr, out.stderr
    assert not (tmp_path / "run" / "prometheus" / "monitor.json").exists()
    down = run_cli(cluster.home, "monitor", "down", str(cluster.topology), timeout=60)
    assert down.returncode == 1 and "no monitor runs for this topology" in down.stderr


def test_unwritable_targets_never_break_the_controller(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    cluster = write_topology(tmp_path)
    topology = load_topology(cluster.topology)
    workers, router = cluster_plans(topology)
    spec = ClusterSpec(namespace="t", endpoint="e", workers=tuple(workers), router=router,
                       node_addresses=(("local", "127.0.0.1"),))
    targets_dir(topology.run_dir_path).parent.mkdir(parents=True)
    targets_dir(topology.run_dir_path).write_text("a file where the folder should be")
    record_targets(spec, ())
    assert "cannot write the Prometheus targets" in caplog.text


def test_a_monitor_process_that_fails_shows_its_own_log_lines_not_an_earlier_starts(tmp_path: Path) -> None:
    """The monitor's logs are appended to across `monitor up`s: a start that failed after few lines showed the last
    lines of the one before it as its own."""
    log = tmp_path / "exporter.log"
    log.write_text("".join(f"earlier start line {i}\n" for i in range(40)))
    proc, offset = _spawn([sys.executable, "-c", "print('this start: bad flag'); raise SystemExit(2)"], log)
    with pytest.raises(MonitorError) as err:
        _wait_ok(proc, "http://127.0.0.1:9/metrics", (log, offset), timeout_s=30)
    assert "exited with code 2" in str(err.value) and "this start: bad flag\n" in str(err.value)
    assert "earlier start line" not in str(err.value), str(err.value)
