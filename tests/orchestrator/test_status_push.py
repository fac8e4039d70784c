"""The supervisor's status pusher: a changed row goes at once, an unchanged one only as a heartbeat, a failed push
goes again. Driven step by step on a test clock (`push_once`); the thread is exercised in test_supervisor."""

from __future__ import annotations

from dataclasses import replace

from dsv4_cluster.core import KvUsage, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.supervise.status_push import HEARTBEAT_S, PushError, StatusPusher


class Worker:
    """The supervisor's side: its current row, read afresh (a new `reported_at`) at every read."""

    def __init__(self) -> None:
        self.row = WorkerStatus("decode-0", Role.DECODE, "local", WorkerState.READY, 42, 30200, 0,
                                KvUsage(4096, 0), "/x/decode-0.log")
        self.reads = 0
        self.now = 0.0
        self.sent: list[WorkerStatus] = []
        self.failing = False

    def read(self) -> WorkerStatus:
        self.reads += 1
        return replace(self.row, reported_at=float(self.reads))

    def send(self, row: WorkerStatus) -> None:
        if self.failing:
            raise PushError("the controller is restarting")
        self.sent.append(row)


def _pusher(w: Worker) -> StatusPusher:
    return StatusPusher("decode-0", w.read, w.send, clock=lambda: w.now)


def test_a_changed_row_goes_at_once_and_an_unchanged_one_only_as_a_heartbeat() -> None:
    w = Worker()
    p = _pusher(w)
    assert p.push_once() and w.sent[-1].kv == KvUsage(4096, 0)   # the announcement
    w.now += HEARTBEAT_S / 2
    assert not p.push_once()                                     # nothing new, no heartbeat due
    w.row = replace(w.row, kv=KvUsage(4096, 16))
    assert p.push_once() and w.sent[-1].kv == KvUsage(4096, 16)  # KV read on the poll changed: pushed
    w.now += HEARTBEAT_S - 0.1
    assert not p.push_once()
    w.now += 0.1
    assert p.push_once()                                         # the heartbeat, unchanged
    assert [r.reported_at for r in w.sent] == sorted(r.reported_at for r in w.sent)
    assert len(w.sent) == 3


def test_a_failed_push_goes_again_with_the_row_of_that_moment() -> None:
    w = Worker()
    p = _pusher(w)
    assert p.push_once()
    w.failing, w.row = True, replace(w.row, state=WorkerState.DEGRADED)
    assert not p.push_once()
    w.failing, w.row = False, replace(w.row, state=WorkerState.READY)  # back to what the controller has
    assert p.push_once()   # sent anyway: the controller may have lost what it had (a restarted controller)
    assert [r.state for r in w.sent] == [WorkerState.READY, WorkerState.READY]
