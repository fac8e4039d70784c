"""The controller's end of status: the latest row each supervisor pushed (`status_push.py`), read without asking
anyone. A supervisor silent for longer than `SILENT_AFTER_S` (dead, restarting or hung: a hung actor is ALIVE to
Ray, so the age of its last push is what tells) is shown without a state, never as its last READY. This module
imports no Ray."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from dsv4_cluster.core import WorkerStatus
from dsv4_cluster.orchestrator.supervise.status_push import HEARTBEAT_S

# A live supervisor pushes at least every HEARTBEAT_S (two health polls); five polls leave three of slack for a
# push slowed by a busy machine or a controller that was itself restarting.
SILENT_AFTER_S = HEARTBEAT_S + 6.0


@dataclass(frozen=True)
class _Kept:
    row: WorkerStatus
    heard_at: float  # the controller's clock when the row arrived (or the supervisor was created)


def silent_row(last: WorkerStatus, silent_s: float) -> WorkerStatus:
    """`last` as shown once its supervisor has been silent for `silent_s`: no state, pid or readings (its worker may
    have died with it), the restarts and history it last reported, and why."""
    before = (f"; its last report: {last.state.value}, pid {last.pid}" if last.state is not None
              else f"; {last.error}" if last.error else "")
    return WorkerStatus(last.name, last.role, last.node, None, None, last.port, last.restarts, None, last.log_path,
                        error=f"no report from its supervisor for {silent_s:.0f}s (dead or hung){before}",
                        history=last.history, ray_node_id=last.ray_node_id)


class RowStore:
    """The newest row per process; `rows()` in the order asked (start order), silent supervisors marked."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._kept: dict[str, _Kept] = {}
        self._lock = threading.Lock()

    def expect(self, placeholder: WorkerStatus) -> None:
        """A supervisor now exists for `placeholder.name`: until it reports, show `placeholder` (its silence is
        counted from now). A row it already reported is kept."""
        with self._lock:
            self._kept.setdefault(placeholder.name, _Kept(placeholder, self._clock()))

    def put(self, row: WorkerStatus) -> bool:
        """Keep `row` unless a row read later (`reported_at`) is kept already; whether it was kept."""
        with self._lock:
            kept = self._kept.get(row.name)
            if kept is not None and _newer_or_same(kept.row, row):
                return False
            self._kept[row.name] = _Kept(row, self._clock())
            return True

    def forget(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                self._kept.pop(name, None)

    def rows(self, names: Iterable[str]) -> list[WorkerStatus]:
        """The kept row of each of `names` that has one, in that order; a silent supervisor's as `silent_row`."""
        now, out = self._clock(), []
        with self._lock:
            kept = [self._kept[n] for n in names if n in self._kept]
        for k in kept:
            silent_s = now - k.heard_at
            out.append(silent_row(k.row, silent_s) if silent_s > SILENT_AFTER_S else k.row)
        return out


def _newer_or_same(kept: WorkerStatus, row: WorkerStatus) -> bool:
    """Whether `kept` was read no earlier than `row` (a placeholder, never read, is older than any report)."""
    return kept.reported_at is not None and (row.reported_at is None or kept.reported_at >= row.reported_at)
