"""A supervised process's status row: its state as the supervisor holds it, plus what the running
worker is read back as (KV usage and kernels from `/server_info`, SGLang's rank attestations, stranded
KV from a prefill's `/metrics`, pinning from `/proc`)."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from dsv4_cluster.core import KvUsage, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import log_tail
from dsv4_cluster.orchestrator.readback.pinning import pinning_report
from dsv4_cluster.orchestrator.readback.probe import ProbeError, engine_info
from dsv4_cluster.orchestrator.readback.stranded import stranded_kv
from dsv4_cluster.orchestrator.verify.kernels import attested_kernels

logger = logging.getLogger(__name__)

STATUS_TAIL_LINES = 10  # of a worker that is not READY, in `status`


def status_row(plan: LaunchPlan, http: httpx.Client, state: WorkerState, error: str | None, restarts: int,
               history: list[dict[str, Any]], pid: int | None) -> WorkerStatus:
    """The status row of `plan`'s process, `pid` while it runs."""
    kv: KvUsage | None = None
    stranded: dict[str, int] | None = None
    kernels: tuple[tuple[str, str], ...] = ()
    if state is WorkerState.READY and plan.server_info_url is not None:
        try:
            info = engine_info(http, plan.server_info_url, plan.metrics_url)
            kv, kernels = info.kv, info.kernels
        except (httpx.HTTPError, ProbeError, ValueError) as e:
            error = f"/server_info probe failed: {e}"
        kernels = kernels or attested_kernels(plan, pid)  # SGLang: its ranks attest, not /server_info
        stranded = _stranded_kv(plan, http)
    troubled = state in (WorkerState.DEGRADED, WorkerState.RESTARTING, WorkerState.FAILED)
    return WorkerStatus(
        name=plan.name, role=plan.role, node=plan.node, state=state, pid=pid,
        port=plan.port, restarts=restarts, kv=kv, log_path=plan.log_path, error=error,
        kernels=kernels, log_tail=log_tail(plan.log_path, STATUS_TAIL_LINES) if troubled else None,
        pinning=pinning_report(plan, pid) if pid is not None else None, stranded_kv=stranded, history=history,
    )


def _stranded_kv(plan: LaunchPlan, http: httpx.Client) -> dict[str, int] | None:
    """A prefill's stranded-KV numbers from its /metrics (None: not a prefill, or not exported)."""
    if plan.role is not Role.PREFILL or plan.metrics_url is None:
        return None
    try:
        return stranded_kv(http, plan.metrics_url)
    except httpx.HTTPError as e:
        logger.debug("%s: no stranded-KV numbers: %s", plan.name, e)
        return None
