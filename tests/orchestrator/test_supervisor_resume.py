"""A supervisor that Ray restarts after its process died goes on with the worker's status history: `status` shows
the crashes and restarts from before, then the supervisor's own death, not a history that starts at it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from dsv4_cluster.orchestrator.supervise import supervisor as supervisor_module
from dsv4_cluster.orchestrator.supervise.supervisor import (
    RestartPolicy,
    WorkerSupervisor,
)

from tests.helpers import wait_for
from tests.orchestrator.test_supervisor import _plan, _wait_for


def test_a_supervisor_restarted_by_ray_keeps_the_history_of_the_one_that_died(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(supervisor_module, "current_actor_id", lambda: "actor-1")   # as inside its Ray actor
    plan = _plan(tmp_path)
    first = WorkerSupervisor(plan, RestartPolicy(max_restarts=5, backoff_s=0.2))
    os.kill(first.start(timeout_s=30).pid, signal.SIGKILL)   # one crash
    try:
        _wait_for(first, lambda s: s.restarts == 1 and s.state == "READY")
        record = Path(plan.cwd, "actors", "supervisor-decode-t.json")
        wait_for(lambda: record.read_text().count('"READY"') == 2, 10, "the restarted worker's READY in the record")
        died = record.read_text()   # the record as the supervisor's process left it when it died
    finally:
        first.stop(deadline_s=5)
    before = [(e["event"], e.get("state")) for e in first.status().history]
    assert ("state", "RESTARTING") in before
    record.write_text(died)
    second = WorkerSupervisor(plan, RestartPolicy(max_restarts=5, backoff_s=0.2))   # Ray reruns the constructor
    try:
        status = _wait_for(second, lambda s: s.state == "READY")
        events = [(e["event"], e.get("state")) for e in status.history]
        assert events[:5] == [("spawn", None), ("state", "READY"), ("state", "RESTARTING"), ("spawn", None),
                              ("state", "READY")], events
        assert events[-3:] == [("state", "STARTING"), ("spawn", None), ("state", "READY")], events
        assert "Ray restarted the supervisor" in status.history[-3]["reason"] and status.restarts == 2 and status.pid
    finally:
        second.stop(deadline_s=5)


def test_a_supervisor_restarted_by_ray_goes_on_with_the_crash_window(tmp_path: Path, monkeypatch) -> None:
    """The crash window was not in the record: a worker crashing between supervisor restarts was never FAILED
    (9 restarts under a limit of 3, seen by the monitoring review)."""
    monkeypatch.setattr(supervisor_module, "current_actor_id", lambda: "actor-1")
    plan, policy = _plan(tmp_path), RestartPolicy(max_restarts=1, backoff_s=0.2)
    record = Path(plan.cwd, "actors", "supervisor-decode-t.json")
    first = WorkerSupervisor(plan, policy)
    os.kill(first.start(timeout_s=30).pid, signal.SIGKILL)   # the one crash the window allows
    try:
        _wait_for(first, lambda s: s.restarts == 1 and s.state == "READY")
        wait_for(lambda: record.read_text().count('"READY"') == 2, 10, "the restarted worker's READY in the record")
        died = record.read_text()
    finally:
        first.stop(deadline_s=5)
    record.write_text(died)
    second = WorkerSupervisor(plan, policy)   # Ray reruns the constructor
    try:
        os.kill(_wait_for(second, lambda s: s.state == "READY").pid, signal.SIGKILL)   # a second within the window
        status = _wait_for(second, lambda s: s.state == "FAILED")
        assert status.state == "FAILED" and "crash loop" in (status.error or ""), status
    finally:
        second.stop(deadline_s=5)
