"""The orchestrator's metrics for Prometheus (`python -m dsv4_cluster.orchestrator.monitor.exporter`, job
`dsv4-orchestrator`): each process's supervisor state and restarts, asked of the recorded cluster's controller at
every scrape, and `dsv4_cluster_controller_up`. It follows the cluster record, so it survives `down` and `up`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import socket
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from dsv4_cluster import metric_names as m
from dsv4_cluster.core import WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.cluster.ray_env import prepare_ray_env
from dsv4_cluster.orchestrator.cluster.record import ClusterRecord, RecordError, read_record
from dsv4_cluster.orchestrator.processes import stop_on_signals

STATUS_TIMEOUT_S = 10.0  # the controller's status call
DRIVER_TIMEOUT_S = 30.0  # the child's answer, including its first connect to Ray
LABELS = ("worker", "role", "node")
logger = logging.getLogger(__name__)


def _driver(conn: Connection, address: str, namespace: str) -> None:
    """Child process: a Ray driver of the recorded cluster answering "status" requests on `conn`."""
    prepare_ray_env(address)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from dsv4_cluster.orchestrator.cluster import ray_cluster
    from dsv4_cluster.orchestrator.supervise.controller import CONTROLLER_NAME, READ_RETRIES

    ray_cluster.connect(address, namespace)
    while conn.recv() == "status":
        try:
            controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
            reply = controller.status.options(max_task_retries=READ_RETRIES).remote()  # through a restart
            conn.send(list(ray.get(reply, timeout=STATUS_TIMEOUT_S).workers))
        except (ValueError, RayActorError, GetTimeoutError) as e:
            conn.send(f"the controller does not answer: {e}")


class ClusterStatusSource:
    """The recorded cluster's status rows, through its controller.

    The Ray driver lives in a child process: a driver whose cluster went away (`down`) blocks and
    then kills its process, so the exporter kills the child instead and starts a new one for the
    next recorded cluster.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._record: ClusterRecord | None = None
        self._child: BaseProcess | None = None
        self._conn: Connection | None = None

    def _stop_child(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
        self._child = self._conn = None

    def _start_child(self, record: ClusterRecord) -> Connection:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: Ray's env is set before import
        self._conn, child_conn = ctx.Pipe()
        self._child = ctx.Process(target=_driver, args=(child_conn, record.address, record.namespace),
                                  daemon=True, name="exporter-ray-driver")
        self._child.start()
        child_conn.close()
        return self._conn

    def _reachable(self, record: ClusterRecord) -> bool:
        host, _, port = record.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except (OSError, ValueError):
            return False
        return True

    def rows(self) -> list[WorkerStatus] | None:
        """The controller's rows, or None when no cluster answers."""
        with self._lock:
            try:
                record: ClusterRecord | None = read_record()
            except RecordError:
                record = None
            if record != self._record:
                self._stop_child()
                self._record = record
            if record is None or not self._reachable(record):
                self._stop_child()
                return None
            conn = self._conn if self._conn is not None else self._start_child(record)
            try:
                conn.send("status")
                if not conn.poll(DRIVER_TIMEOUT_S):
                    raise TimeoutError(f"no answer within {DRIVER_TIMEOUT_S:.0f}s")
                reply = conn.recv()
            except (OSError, EOFError, TimeoutError) as e:
                logger.warning("the Ray driver failed (%s); a new one starts at the next scrape", e)
                self._stop_child()
                return None
            if isinstance(reply, str):
                logger.warning("%s", reply)
                return None
            return list(reply)

    def close(self) -> None:
        with self._lock:
            self._stop_child()


def families(rows: list[WorkerStatus] | None) -> Iterator[Metric]:
    """The exported families for these status rows (None: no cluster answers)."""
    up = GaugeMetricFamily(m.CLUSTER_CONTROLLER_UP, "1 when the recorded cluster's controller answers")
    up.add_metric([], 0.0 if rows is None else 1.0)
    yield up
    state = GaugeMetricFamily(m.CLUSTER_WORKER_STATE, "Supervisor state of each process (1 = current)",
                              labels=[*LABELS, "state"])
    restarts = CounterMetricFamily(m.CLUSTER_WORKER_RESTARTS,
                                   "Restarts of each process by its supervisor", labels=list(LABELS))
    for row in rows or []:
        if row.state is None:  # a supervisor that did not answer: no state to report
            continue
        labels = [row.name, row.role.value, row.node]
        for s in WorkerState:
            state.add_metric([*labels, s.value], 1.0 if row.state is s else 0.0)
        restarts.add_metric(labels, float(row.restarts))
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
    p = argparse.ArgumentParser(prog="python -m dsv4_cluster.orchestrator.monitor.exporter",
                                description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    source = ClusterStatusSource()
    registry = CollectorRegistry()
    registry.register(_Collector(source))
    server, _ = start_http_server(args.port, addr=args.host, registry=registry)
    logger.info("orchestrator metrics on http://%s:%d/metrics", args.host, args.port)
    stop = stop_on_signals()
    while not stop.wait(1.0):
        pass
    server.shutdown()
    source.close()


if __name__ == "__main__":
    main()
