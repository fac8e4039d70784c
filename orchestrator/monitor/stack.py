"""`dsv4-cluster monitor up|down FILE`: Prometheus on loopback next to the cluster, with the generated scrape config
and alert rules, the orchestrator's exporter, and Grafana's files.

Both processes run in their own process groups and outlive the CLI; `<run_dir>/prometheus/monitor.json` records
their pids for `down`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from dsv4_cluster.orchestrator.launch.ports import port_is_free
from dsv4_cluster.orchestrator.processes import group_members, start_logged, stop_groups, with_log_tail
from dsv4_cluster.orchestrator.monitor.prometheus_config import ScrapeOptions, prometheus_dir, write_config
from dsv4_cluster.orchestrator.monitor.targets import write_job

MONITOR_FILE = "monitor.json"
POLL_S = 0.2


class MonitorError(RuntimeError):
    """Monitoring cannot start or stop; the message says why and what to do."""


@dataclass(frozen=True)
class MonitorOptions:
    host: str = "127.0.0.1"
    prometheus_port: int = 9090
    exporter_port: int = 9101
    scrape_interval: str = "5s"
    retention: str = "15d"
    timeout_s: float = 60.0  # for each process to answer, and between SIGTERM and SIGKILL


@dataclass(frozen=True)
class MonitorRecord:
    prometheus_pid: int
    exporter_pid: int
    prometheus_url: str
    exporter_url: str
    config: str
    grafana_dir: str


def _record_path(run_dir: Path) -> Path:
    return prometheus_dir(run_dir) / MONITOR_FILE


def read_monitor(run_dir: Path) -> MonitorRecord | None:
    path = _record_path(run_dir)
    if not path.exists():
        return None
    try:
        return MonitorRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise MonitorError(f"cannot read {path}: {e}; remove it if no monitor runs") from e


def _spawn(argv: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The process, and where its start's lines begin in its appended log (its error tails read from there)."""
    return start_logged(argv, log_path, "monitor", env=dict(os.environ))


def _wait_ok(proc: subprocess.Popen[bytes], url: str, log: tuple[Path, int], timeout_s: float) -> None:
    log_path, offset = log
    end = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise MonitorError(with_log_tail(f"{proc.args[0]} exited with code {proc.returncode} ({log_path})",
                                                 str(log_path), offset))
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
    raise MonitorError(with_log_tail(f"{url} did not answer within {timeout_s:.0f}s ({log_path})", str(log_path),
                                     offset))


def _preflight(run_dir: Path, options: MonitorOptions) -> str:
    existing = read_monitor(run_dir)
    if existing is not None and group_members(existing.prometheus_pid):
        raise MonitorError(f"a monitor already runs for this topology ({existing.prometheus_url}); "
                           "run `dsv4-cluster monitor down FILE` first")
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise MonitorError("`prometheus` is not installed; install Debian's package "
                           "(deploy/install-test-deps.sh, or apt-get install prometheus)")
    for flag, port in (("--port", options.prometheus_port), ("--exporter-port", options.exporter_port)):
        if not port_is_free(port, options.host):
            raise MonitorError(f"{options.host}:{port} is in use; pass a free {flag}")
    return prometheus


def up(topology: Any, options: MonitorOptions) -> MonitorRecord:
    """Start the exporter and Prometheus for `topology`; raises MonitorError (nothing left running)."""
    run_dir = Path(topology.run_dir_path)
    prometheus = _preflight(run_dir, options)
    interval = options.scrape_interval
    config = write_config(topology, ScrapeOptions(interval, interval, interval, interval))
    host = options.host
    write_job(run_dir, "dsv4-orchestrator", [{"targets": [f"{host}:{options.exporter_port}"],
                                              "labels": {"worker": "orchestrator", "role": "orchestrator",
                                                         "node": str(topology.router.node)}}])
    logs = run_dir / "logs"
    started: list[subprocess.Popen[bytes]] = []
    try:
        exporter_log = logs / "exporter.log"
        exporter, exporter_from = _spawn([sys.executable, "-m", "dsv4_cluster.orchestrator.monitor.exporter",
                                          "--host", host, "--port", str(options.exporter_port)], exporter_log)
        started.append(exporter)
        exporter_url = f"http://{host}:{options.exporter_port}"
        _wait_ok(exporter, f"{exporter_url}/metrics", (exporter_log, exporter_from), options.timeout_s)
        prom_log = logs / "prometheus.log"
        prom, prom_from = _spawn([prometheus, f"--config.file={config}",
                                  f"--storage.tsdb.path={prometheus_dir(run_dir) / 'data'}",
                                  f"--storage.tsdb.retention.time={options.retention}",
                                  f"--web.listen-address={host}:{options.prometheus_port}",
                                  "--web.enable-lifecycle"], prom_log)
        started.append(prom)
        prometheus_url = f"http://{host}:{options.prometheus_port}"
        _wait_ok(prom, f"{prometheus_url}/-/ready", (prom_log, prom_from), options.timeout_s)
    except BaseException:
        stop_groups([p.pid for p in started], deadline_s=5.0)
        raise
    from dsv4_cluster.deploy.grafana.dashboards import write_all  # only `monitor up` needs the SDK

    grafana_dir = run_dir / "grafana"
    write_all(grafana_dir / "dashboards", grafana_dir / "provisioning", prometheus_url,
              str(grafana_dir / "dashboards"))
    record = MonitorRecord(prometheus_pid=prom.pid, exporter_pid=exporter.pid, prometheus_url=prometheus_url,
                           exporter_url=exporter_url, config=str(config), grafana_dir=str(grafana_dir))
    _record_path(run_dir).write_text(json.dumps(asdict(record), indent=2) + "\n")
    return record


def down(topology: Any, deadline_s: float) -> list[int]:
    """Stop the recorded monitor; returns pids still alive (empty when all stopped)."""
    run_dir = Path(topology.run_dir_path)
    record = read_monitor(run_dir)
    if record is None:
        raise MonitorError(f"no monitor runs for this topology (no {_record_path(run_dir)})")
    survivors = stop_groups([record.prometheus_pid, record.exporter_pid], deadline_s)
    _record_path(run_dir).unlink(missing_ok=True)
    return survivors


def add_parser(sub: Any) -> None:
    d = MonitorOptions()
    p = sub.add_parser("monitor", help="Prometheus (+ the orchestrator's exporter) next to the cluster")
    msub = p.add_subparsers(dest="monitor_command", required=True)
    mup = msub.add_parser("up", help="start Prometheus on loopback with the generated config and rules")
    mup.add_argument("file", help="topology YAML")
    mup.add_argument("--port", type=int, default=d.prometheus_port,
                     help=f"Prometheus port (default {d.prometheus_port})")
    mup.add_argument("--exporter-port", type=int, default=d.exporter_port,
                     help=f"port of the orchestrator's exporter (default {d.exporter_port})")
    mup.add_argument("--scrape-interval", default=d.scrape_interval,
                     help=f"scrape and rule evaluation interval (default {d.scrape_interval})")
    mdown = msub.add_parser("down", help="stop what `monitor up` started")
    mdown.add_argument("file", help="topology YAML")


def main(args: Any) -> int:
    """The `monitor` command: 0 done, 1 it failed, 2 the topology is unfit."""
    from dsv4_cluster.orchestrator.topology.load import TopologyError, load_topology

    try:
        topology = load_topology(args.file)
    except TopologyError as e:
        print(f"{args.file}: {len(e.problems)} problem(s):\n{e}", file=sys.stderr)
        return 2
    try:
        if args.monitor_command == "down":
            survivors = down(topology, MonitorOptions().timeout_s)
            if survivors:
                print(f"still running after monitor down: pids {survivors}", file=sys.stderr)
                return 1
            print("monitor down; no process left")
            return 0
        record = up(topology, MonitorOptions(prometheus_port=args.port, exporter_port=args.exporter_port,
                                             scrape_interval=args.scrape_interval))
    except MonitorError as e:
        print(str(e), file=sys.stderr)
        return 1
    grafana = Path(record.grafana_dir)
    print(f"prometheus: {record.prometheus_url} (alerts: {record.prometheus_url}/alerts, "
          f"targets: {record.prometheus_url}/targets)")
    print(f"config: {record.config}")
    print(f"orchestrator metrics: {record.exporter_url}/metrics")
    print(f"grafana dashboards: {grafana / 'dashboards'} (provisioning: {grafana / 'provisioning'}; "
          f"point Grafana's paths.provisioning there)")
    print("stop: dsv4-cluster monitor down FILE", flush=True)
    return 0
