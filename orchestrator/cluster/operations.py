"""Day-two operations on a running cluster (drain, restart, logs, a refreshing status): each finds the cluster from
its record and asks the controller, which asks the worker's supervisor and the router's admin API.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dsv4_cluster.core import WorkerStatus
from dsv4_cluster.orchestrator.cluster import deployment, ray_cluster
from dsv4_cluster.orchestrator.errors import ClusterStartError, NotUpError, RayClusterError, UnknownWorkerError
from dsv4_cluster.orchestrator.cluster.log_files import last_run_log, log_of
from dsv4_cluster.orchestrator.cluster.record import RecordError, read_record, record_path
from dsv4_cluster.orchestrator.supervise.controller import Drained
from dsv4_cluster.orchestrator.supervise.router_admin import RouterAdminError

_TYPED = (UnknownWorkerError, RouterAdminError, ClusterStartError)


def _call(method: str, *args: Any, timeout_s: float) -> Any:
    """controller.<method>(*args), with the controller's typed errors raised here as themselves."""
    record = read_record()
    try:
        controller = deployment.find_controller(record)
        return ray.get(getattr(controller, method).remote(*args), timeout=timeout_s)
    except RayTaskError as e:
        if isinstance(e.cause, _TYPED):
            raise e.cause from None
        raise
    except (RayActorError, GetTimeoutError) as e:
        raise NotUpError(f"the controller does not answer: {e}") from e
    except RayClusterError as e:
        raise NotUpError(f"the cluster from {record.topology_path} is gone ({e})") from e
    finally:
        ray_cluster.disconnect()


def drain(name: str, deadline_s: float, stop_deadline_s: float) -> Drained:
    return _call("drain", name, deadline_s, stop_deadline_s, timeout_s=deadline_s + stop_deadline_s + 60)


def restart(name: str, timeout_s: float, stop_deadline_s: float) -> WorkerStatus:
    return _call("restart", name, timeout_s, stop_deadline_s, timeout_s=timeout_s + stop_deadline_s + 60)


def log_path(name: str) -> tuple[str, str | None]:
    """The log file of `name` (a worker or the router), from the cluster's status through Ray; with no cluster up,
    the last one's log of that name, and a note saying so (None while a cluster is up)."""
    try:
        rows = {w.name: w for w in deployment.status().workers}
    except RecordError as e:   # none recorded (a record that is unreadable, or whose cluster is gone, says so)
        if record_path().exists():
            raise
        return last_run_log(name, e)
    return log_of(name, rows), None
