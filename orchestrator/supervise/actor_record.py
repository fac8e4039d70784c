"""What a supervisor or the controller keeps in the run folder (`<run_dir>/actors/<name>.json`) to survive its own
process dying: Ray reruns the constructor of a dead actor in a new process, with the same actor id. A supervisor
records its worker's pid and start time (a recycled pid is never taken for it), restarts, start timeout, status
history, crash window and whether it should run; its worker died with it (PR_SET_PDEATHSIG), so the restarted one
reaps the old group, starts the worker again and goes on with that history and window.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsv4_cluster.orchestrator.processes import group_members, pid_alive, signal_group, start_time, write_atomically

REAP_WAIT_S = 5.0


@dataclass(frozen=True)
class ActorRecord:
    actor_id: str | None
    pid: int
    worker_pid: int | None = None
    worker_start_time: int | None = None
    restarts: int = 0
    start_timeout_s: float | None = None
    running: bool = False  # the worker should be running: started, and not stopped since
    history: list[dict] = field(default_factory=list)   # its status history so far: a restarted supervisor goes on
    crashes: list[float] = field(default_factory=list)   # its crash window (CrashWindow.times): so does the limit


def record_path(run_dir: str | Path, actor_name: str) -> Path:
    return Path(run_dir) / "actors" / f"{actor_name}.json"


def write_actor_record(path: Path, record: ActorRecord) -> None:
    write_atomically(path, json.dumps(asdict(record)) + "\n")


def read_actor_record(path: Path) -> ActorRecord | None:
    """The record, or None when there is none or it is unreadable (then nothing is resumed)."""
    try:
        return ActorRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def current_actor_id() -> str | None:
    """This process's Ray actor id; None outside a Ray actor."""
    import ray  # the orchestrator's modules import ray; the supervisor also runs outside it in tests

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_actor_id()


def reap_worker(record: ActorRecord) -> list[int]:
    """SIGKILL what is left of the recorded worker's process group; returns the pids it found.

    The group id is the worker's pid (it leads its own session). While any member lives, Linux does not
    hand that id to a new process; a live leader with another start time means the id was recycled, so
    nothing is touched.
    """
    pgid = record.worker_pid
    if pgid is None:
        return []
    if pid_alive(pgid) and start_time(pgid) != record.worker_start_time:
        return []
    members = group_members(pgid)
    if members:
        signal_group(pgid, signal.SIGKILL)
        end = time.monotonic() + REAP_WAIT_S
        while group_members(pgid) and time.monotonic() < end:
            time.sleep(0.05)
    return members
