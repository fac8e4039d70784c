"""The log file `logs NAME` prints: a process's, from status rows however they were read, or with no cluster
recorded the last cluster's (its logs outlive `down`); read to its end, then followed. No Ray here: while the
status endpoint answers, `logs` never connects to the cluster.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator

from dsv4_cluster.core import WorkerStatus
from dsv4_cluster.orchestrator.errors import NotUpError, UnknownWorkerError
from dsv4_cluster.orchestrator.cluster.record import RecordError, last_run

FOLLOW_POLL_S = 0.25


def log_of(name: str, rows: dict[str, WorkerStatus]) -> str:
    """The log path of `name` among the cluster's status rows (by process name)."""
    if name not in rows:
        raise UnknownWorkerError(f"no process named {name!r}; this cluster has {sorted(rows)}")
    return rows[name].log_path


def last_run_log(name: str, none_recorded: RecordError) -> tuple[str, str]:
    """With no cluster recorded: the last cluster's log of `name`, and a note saying whose it is."""
    last = last_run()
    logs = last[0] / "logs" if last else None
    if logs is None or not (logs / f"{name}.log").exists():
        known = f"; the last cluster's logs ({logs}) have none named {name!r}: " \
                f"{sorted(p.stem for p in logs.glob('*.log'))}" if logs else ""
        raise NotUpError(f"{none_recorded}{known}") from None
    ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last[1]))
    return str(logs / f"{name}.log"), f"no cluster is up; the log of the last one, stopped at {ended}"


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
