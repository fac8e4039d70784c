"""Prometheus `file_sd` targets, written only here: the controller calls `record_targets` when it starts or stops
processes on purpose (up, drain, restart, down), never when status is read; `monitor up` writes the exporter's own
job through `write_job` (`stack.py`). Every process the cluster means to run is a target, whatever its state, so
`up == 0` fires the worker-down alert; one stopped on purpose is not. Writes are atomic and only on change.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from dsv4_cluster.core import Role
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import write_atomically

TARGETS_SUBDIR = ("prometheus", "targets")
logger = logging.getLogger(__name__)
JOB_FILES = {"dsv4-router": "router.json", "dsv4-workers": "workers.json",
             "dsv4-orchestrator": "orchestrator.json"}


def targets_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).joinpath(*TARGETS_SUBDIR)


def _address(url: str) -> str:
    """host:port of a URL, as a Prometheus target."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"{url!r} has no host:port")
    return f"{parts.hostname}:{parts.port}"


def plan_target(plan: LaunchPlan) -> dict[str, Any]:
    """One file_sd entry: the process's metrics address with its worker/role/node labels."""
    url = plan.metrics_url or plan.health_url  # the router serves /metrics beside /health
    return {"targets": [_address(url)],
            "labels": {"worker": plan.name, "role": plan.role.value, "node": plan.node}}


def write_job(run_dir: str | Path, job: str, entries: list[dict[str, Any]]) -> Path:
    """Atomically replace one job's targets file (no write when unchanged)."""
    path = targets_dir(run_dir) / JOB_FILES[job]
    text = json.dumps(entries, indent=2, sort_keys=True) + "\n"
    if path.exists() and path.read_text() == text:
        return path
    write_atomically(path, text)
    return path


def write_plans(run_dir: str | Path, plans: Iterable[LaunchPlan], stopped: frozenset[str] = frozenset()) -> None:
    """The router and worker files for these plans, leaving out the named stopped processes."""
    live = [p for p in plans if p.name not in stopped]
    write_job(run_dir, "dsv4-router", [plan_target(p) for p in live if p.role is Role.ROUTER])
    write_job(run_dir, "dsv4-workers", [plan_target(p) for p in live if p.role is not Role.ROUTER])


def listed(run_dir: str | Path) -> set[str]:
    """The processes the router and worker targets files list now (none where there is no file)."""
    names: set[str] = set()
    for job in ("dsv4-router", "dsv4-workers"):
        try:
            entries = json.loads((targets_dir(run_dir) / JOB_FILES[job]).read_text())
        except (OSError, ValueError):
            continue
        names |= {e["labels"]["worker"] for e in entries}
    return names


def record_targets(spec: Any, stopped: Iterable[str]) -> None:
    """The controller's call: every process of `spec` (a ClusterSpec) is a target but those in `stopped`. A
    targets file that cannot be written is logged, never raised: monitoring must not break the cluster."""
    try:
        write_plans(spec.router.cwd, (*spec.workers, spec.router), frozenset(stopped))
    except OSError as e:
        logger.warning("cannot write the Prometheus targets under %s: %s", targets_dir(spec.router.cwd), e)
