"""The status table `up` and `status` print: one row per supervised process."""

from __future__ import annotations

from typing import Any

from dsv4_cluster.orchestrator.launch.capacity import PREDICTED_COLUMN, kv_predicted_cell
from dsv4_cluster.orchestrator.readback.stranded import stranded_line

COLUMNS = ("NAME", "ROLE", "NODE", "PID", "STATE", "RESTARTS", "PORT", "KV_CAPACITY", "KV_USED",
           PREDICTED_COLUMN)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def status_rows(workers: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [
        tuple(_cell(w.get(k)) for k in ("name", "role", "node", "pid", "state", "restarts", "port",
                                         "kv_capacity_tokens", "kv_used_tokens")) + (kv_predicted_cell(w),)
        for w in workers
    ]


def render_table(status: dict[str, Any]) -> str:
    """The table, one line per process that reports an error, one per deep-probed pair."""
    rows = [COLUMNS, *status_rows(status["workers"])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for w in status["workers"]:
        if w.get("error"):
            lines.append(f"{w.get('name', '?')}: {w['error']}")
        stranded = stranded_line(w)
        if stranded:
            lines.append(stranded)
        held = (w.get("pinning") or {}).get("gpus_held")
        if held:
            lines.append(f"{w['name']}: holds GPU {', '.join(map(str, held))} (CUDA contexts, read from the NVIDIA driver)")
        mismatch = (w.get("pinning") or {}).get("mismatch")
        if mismatch:
            lines.append(f"{w['name']}: PINNING differs from the topology: {'; '.join(mismatch)}")
    for p in status.get("probes", []):
        outcome = f"ok in {p['seconds']:.2f}s" if p["ok"] else f"FAILED: {p['error']}"
        lines.append(f"deep probe {p['prefill']} -> {p['decode']}: {outcome}")
    return "\n".join(lines)
