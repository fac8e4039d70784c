"""The status as the CLI shows it: the table `up` and `status` print (one row per supervised process), and
`status` read from the controller's loopback endpoint (no Ray, none of the other commands' imports)."""

from __future__ import annotations

import json
import time
from typing import Any

from dsv4_cluster.core import ClusterStatus, ProbeResult, WorkerStatus
from dsv4_cluster.orchestrator.cluster.record import RecordError, read_record
from dsv4_cluster.orchestrator.launch.capacity import PREDICTED_COLUMN
from dsv4_cluster.orchestrator.readback.stranded import stranded_line
from dsv4_cluster.orchestrator.supervise.status_endpoint import EndpointUnavailable, read_status

COLUMNS = ("NAME", "ROLE", "NODE", "PID", "STATE", "RESTARTS", "PORT", "KV_CAPACITY", "KV_USED",
           PREDICTED_COLUMN)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def status_rows(workers: tuple[WorkerStatus, ...]) -> list[tuple[str, ...]]:
    return [tuple(map(_cell, (w.name, w.role.value, w.node, w.pid, w.state.value if w.state else None, w.restarts,
                              w.port, w.kv.capacity_tokens if w.kv else None, w.kv.used_tokens if w.kv else None,
                              w.kv_predicted_tokens)))
            for w in workers]


def render_table(status: ClusterStatus) -> str:
    """The table, one line per process that reports an error, one per deep-probed pair."""
    rows = [COLUMNS, *status_rows(status.workers)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for w in status.workers:
        if w.error:
            lines.append(f"{w.name}: {w.error}")
        stranded = stranded_line(w)
        if stranded:
            lines.append(stranded)
        held = (w.pinning or {}).get("gpus_held")
        if held:
            lines.append(f"{w.name}: holds GPU {', '.join(map(str, held))} (CUDA contexts, read from the NVIDIA driver)")
        mismatch = (w.pinning or {}).get("mismatch")
        if mismatch:
            lines.append(f"{w.name}: PINNING differs from the topology: {'; '.join(mismatch)}")
    lines += [probe_line(p, status.workers) for p in status.probes]
    return "\n".join(lines)


def probe_line(p: ProbeResult, workers: tuple[WorkerStatus, ...]) -> str:
    """A deep probe's outcome, its age (it runs every 30 s), and which of its pair is not READY now: an 'ok'
    from before a worker failed or stopped must not read as its health."""
    outcome = f"ok in {p.seconds:.2f}s" if p.ok else f"FAILED: {p.error}"
    age = max(0.0, time.time() - p.at)
    states = {w.name: (w.state.value if w.state else "no state") for w in workers}
    changed = [f"{n} is {states[n]} now" for n in (p.prefill, p.decode) if states.get(n, "READY") != "READY"]
    return f"deep probe {p.prefill} -> {p.decode}: {outcome} ({age:.0f}s ago){''.join(f'; {c}' for c in changed)}"


def endpoint_status() -> tuple[ClusterStatus | None, str | None]:
    """The controller's status through its endpoint; else (None, why not: None when no cluster is recorded,
    which the Ray path reports)."""
    try:
        record = read_record()
    except RecordError:
        return None, None
    try:
        return read_status(record.run_dir), None
    except EndpointUnavailable as e:
        return None, f"{e}; asking the controller through Ray"


def print_status(status: ClusterStatus, as_json: bool) -> None:
    print(json.dumps(status.to_dict(), indent=2) if as_json else render_table(status), flush=True)
