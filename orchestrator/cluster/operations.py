"""Day-two operations on a running cluster (drain, restart, logs, a refreshing status): each finds the cluster from
its record and asks the controller, which asks the worker's supervisor and the router's admin API.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dsv4_cluster.core import WorkerStatus
from dsv4_cluster.orchestrator.cluster import deployment, ray_cluster
from dsv4_cluster.orchestrator.errors import ClusterStartError, NotUpError, RayClusterError, UnknownWorkerError
from dsv4_cluster.orchestrator.cluster.record import RecordError, last_run, read_record, record_path
from dsv4_cluster.orchestrator.supervise.controller import Drained
from dsv4_cluster.orchestrator.supervise.router_admin import RouterAdminError

FOLLOW_POLL_S = 0.25
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
    """The log file of `name` (a worker or the router), from the cluster's status; with no cluster up, the last
    one's log of that name, and a note saying so (None while a cluster is up)."""
    try:
        rows = {w.name: w for w in deployment.status().workers}
    except RecordError as e:   # none recorded (a record that is unreadable, or whose cluster is gone, says so)
        if record_path().exists():
            raise
        last = last_run()
        logs = last[0] / "logs" if last else None
        if logs is None or not (logs / f"{name}.log").exists():
            known = f"; the last cluster's logs ({logs}) have none named {name!r}: " \
                    f"{sorted(p.stem for p in logs.glob('*.log'))}" if logs else ""
            raise NotUpError(f"{e}{known}") from None
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last[1]))
        return str(logs / f"{name}.log"), f"no cluster is up; the log of the last one, stopped at {ended}"
    if name not in rows:
        raise UnknownWorkerError(f"no process named {name!r}; this cluster has {sorted(rows)}")
    return rows[name].log_path, None


def read_log(path: str, lines: int | None, follow: bool,
             stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
    """The last `lines` lines of the file (None: all), then (with `follow`) what is appended, until
    `stop()`; a file that is replaced (a restart appends, but rotation may replace) is reopened."""
    p = Path(path)
    if not p.exists():
        raise NotUpError(f"{path} is not on this machine; run `logs` on the worker's node")
    with p.open(errors="replace") as f:
        existing = f.readlines()
        yield from existing if lines is None else existing[len(existing) - min(lines, len(existing)):]
        inode = os.fstat(f.fileno()).st_ino
        while follow and not stop():
            chunk = f.readline()
            if chunk:
                yield chunk
                continue
            if p.exists() and p.stat().st_ino != inode:
                yield from read_log(path, None, follow, stop)
                return
            time.sleep(FOLLOW_POLL_S)
