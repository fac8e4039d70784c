"""A supervised process's status row: its state as the supervisor holds it, plus what the running worker was read
back as on the supervisor's last poll (`Readings`: KV usage and kernels from `/server_info`, SGLang's rank
attestations, stranded KV from a prefill's `/metrics`, pinning from `/proc`)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import httpx

from dsv4_cluster.core import KvUsage, Role, StrandedKv, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import log_tail
from dsv4_cluster.orchestrator.readback.pinning import pinning_report
from dsv4_cluster.orchestrator.readback.probe import ProbeError, engine_info
from dsv4_cluster.orchestrator.readback.stranded import stranded_kv
from dsv4_cluster.orchestrator.verify.kernels import attested_kernels

logger = logging.getLogger(__name__)

STATUS_TAIL_LINES = 10  # of a worker that is not READY, in `status`


@dataclass(frozen=True)
class Readings:
    """What one process was read back as, with the pid it was read from (a row shows them only for that pid)."""

    pid: int
    kv: KvUsage | None = None
    kernels: tuple[tuple[str, str], ...] = ()
    stranded_kv: StrandedKv | None = None
    pinning: dict[str, Any] | None = None
    error: str | None = None  # a probe that failed


def take_readings(plan: LaunchPlan, http: httpx.Client, pid: int,
                  pinning: dict[str, Any] | None) -> Readings:
    """`plan`'s READY process read back now; `pinning`: the last pinning report, None to read it again."""
    kv: KvUsage | None = None
    kernels: tuple[tuple[str, str], ...] = ()
    error = stranded = None
    if plan.server_info_url is not None:
        try:
            info = engine_info(http, plan.server_info_url, plan.metrics_url)
            kv, kernels = info.kv, info.kernels
        except (httpx.HTTPError, ProbeError, ValueError) as e:
            error = f"/server_info probe failed: {e}"
        kernels = kernels or attested_kernels(plan, pid)  # SGLang: its ranks attest, not /server_info
        stranded = _stranded_kv(plan, http)
    return Readings(pid, kv, kernels, stranded, pinning if pinning is not None else pinning_report(plan, pid), error)


def status_row(plan: LaunchPlan, state: WorkerState, error: str | None, restarts: int,
               history: list[dict[str, Any]], pid: int | None, readings: Readings | None,
               reported_at: float, ray_node_id: str | None) -> WorkerStatus:
    """The status row of `plan`'s process, `pid` while it runs; the readings of that pid, KV and kernels while
    it is READY."""
    r = readings if readings is not None and pid is not None and readings.pid == pid else None
    ready = r is not None and state is WorkerState.READY
    troubled = state in (WorkerState.DEGRADED, WorkerState.RESTARTING, WorkerState.FAILED)
    return WorkerStatus(
        name=plan.name, role=plan.role, node=plan.node, state=state, pid=pid,
        port=plan.port, restarts=restarts, kv=r.kv if ready else None, log_path=plan.log_path,
        error=r.error if ready and r.error else error, kernels=r.kernels if ready else (),
        log_tail=log_tail(plan.log_path, STATUS_TAIL_LINES) if troubled else None,
        pinning=r.pinning if r is not None else None, stranded_kv=r.stranded_kv if ready else None,
        history=history, ray_node_id=ray_node_id, reported_at=reported_at,
    )


def ray_node_id() -> str | None:
    """The Ray node this process runs on: a supervisor actor's; None in a process without Ray (a test's)."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None


def _stranded_kv(plan: LaunchPlan, http: httpx.Client) -> StrandedKv | None:
    """A prefill's stranded-KV numbers from its /metrics (None: not a prefill, or not exported)."""
    if plan.role is not Role.PREFILL or plan.metrics_url is None:
        return None
    try:
        return stranded_kv(http, plan.metrics_url)
    except httpx.HTTPError as e:
        logger.debug("%s: no stranded-KV numbers: %s", plan.name, e)
        return None
