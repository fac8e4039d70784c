"""The orchestrator's metrics: each process's supervisor state and restarts, for Prometheus.

    python -m dsv4_cluster.orchestrator.exporter --host 127.0.0.1 --port 9101

`dsv4-cluster monitor up` runs it beside Prometheus (job `dsv4-orchestrator`). At every scrape it
asks the recorded cluster's controller for its status (what `dsv4-cluster status` shows) and
exports `dsv4_cluster_worker_state{worker,role,node,state}` (1 for the current state, 0 for the
others) and `dsv4_cluster_worker_restarts_total`, plus `dsv4_cluster_controller_up` (0 when no
cluster is recorded or its controller does not answer, with no worker series). It follows the
cluster record, so it survives `down` and a later `up`.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from dsv4_cluster import metric_names as m
from dsv4_cluster.core import WorkerState
from dsv4_cluster.orchestrator.ray_env import prepare_ray_env
from dsv4_cluster.orchestrator.record import ClusterRecord, RecordError, read_record

STATUS_TIMEOUT_S = 10.0
LABELS = ("worker", "role", "node")
logger = logging.getLogger(__name__)


class ClusterStatusSource:
    """The recorded cluster's status rows, through its controller; reconnects when the record changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connected: ClusterRecord | None = None

    def rows(self) -> list[dict[str, Any]] | None:
        """The controller's rows, or None when no cluster answers."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from dsv4_cluster.orchestrator import ray_cluster
        from dsv4_cluster.orchestrator.controller import CONTROLLER_NAME
        from dsv4_cluster.orchestrator.errors import RayClusterError

        with self._lock:
            try:
                record = read_record()
            except RecordError:
                record = None
            if record != self._connected:
                ray_cluster.disconnect()
                self._connected = None
                if record is None:
                    return None
                try:
                    ray_cluster.connect(record.address, record.namespace)
                except RayClusterError as e:
                    logger.warning("cluster not reachable: %s", e)
                    return None
                self._connected = record
            try:
                controller = ray.get_actor(CONTROLLER_NAME, namespace=record.namespace)
                return list(ray.get(controller.status.remote(), timeout=STATUS_TIMEOUT_S)["workers"])
            except (ValueError, RayActorError, GetTimeoutError) as e:
                logger.warning("controller does not answer: %s", e)
                return None


def families(rows: list[dict[str, Any]] | None) -> Iterator[Metric]:
    """The exported families for these status rows (None: no cluster answers)."""
    up = GaugeMetricFamily("dsv4_cluster_controller_up", "1 when the recorded cluster's controller answers")
    up.add_metric([], 0.0 if rows is None else 1.0)
    yield up
    state = GaugeMetricFamily(m.CLUSTER_WORKER_STATE, "Supervisor state of each process (1 = current)",
                              labels=[*LABELS, "state"])
    restarts = CounterMetricFamily(m.CLUSTER_WORKER_RESTARTS.removesuffix("_total"),
                                   "Restarts of each process by its supervisor", labels=list(LABELS))
    for row in rows or []:
        if "state" not in row:  # a supervisor that did not answer: no state to report
            continue
        labels = [row["name"], row["role"], row["node"]]
        for s in WorkerState:
            state.add_metric([*labels, s.value], 1.0 if row["state"] == s.value else 0.0)
        restarts.add_metric(labels, float(row.get("restarts", 0)))
    yield state
    yield restarts


class _Collector:
    def __init__(self, source: ClusterStatusSource) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # registering must not ask the cluster: the families are known only per scrape

    def collect(self) -> Iterator[Metric]:
        return families(self._source.rows())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dsv4_cluster.orchestrator.exporter", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        prepare_ray_env(read_record().address)
    except RecordError:
        prepare_ray_env(None)  # no cluster yet: a local one, as `up` starts by default
    registry = CollectorRegistry()
    registry.register(_Collector(ClusterStatusSource()))
    server, thread = start_http_server(args.port, addr=args.host, registry=registry)
    logger.info("orchestrator metrics on http://%s:%d/metrics", args.host, args.port)
    thread.join()


if __name__ == "__main__":
    main()
