"""The controller's row store: the latest row each supervisor pushed, in start order, silent supervisors marked."""

from __future__ import annotations

from dataclasses import replace

from dsv4_cluster.core import KvUsage, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.supervise.row_store import SILENT_AFTER_S, RowStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _row(name: str = "decode-0", at: float | None = 1.0, **kw: object) -> WorkerStatus:
    base = WorkerStatus(name, Role.DECODE, "local", WorkerState.READY, 42, 30200, 1, KvUsage(4096, 16),
                        f"/x/{name}.log", history=[{"at": 0.5, "event": "spawn", "pid": 42}], reported_at=at)
    return replace(base, **kw)


def test_rows_come_in_the_order_asked_not_the_order_pushed() -> None:
    store = RowStore()
    for name in ("router", "decode-0", "prefill-0", "decode-9"):
        store.put(_row(name))
    assert [r.name for r in store.rows(["prefill-0", "decode-0", "router"])] == ["prefill-0", "decode-0", "router"]
    assert [r.name for r in store.rows(["decode-1", "router"])] == ["router"]  # no row yet: not shown
    store.forget(["router"])
    assert store.rows(["router"]) == []


def test_a_row_read_earlier_never_replaces_one_read_later() -> None:
    store = RowStore()
    store.expect(_row(state=None, pid=None, kv=None, at=None, error="its supervisor has not reported yet"))
    assert store.rows(["decode-0"])[0].error == "its supervisor has not reported yet"
    assert store.put(_row(at=2.0, state=WorkerState.STARTING))       # any report replaces the placeholder
    assert store.put(_row(at=3.0))
    assert not store.put(_row(at=2.5, state=WorkerState.RESTARTING))  # a push that arrived late
    assert not store.put(_row(at=3.0, state=WorkerState.FAILED))
    store.expect(_row(state=None, at=None))                           # a controller adopting it keeps the report
    assert store.rows(["decode-0"]) == [_row(at=3.0)]


def test_a_supervisor_silent_past_the_bound_shows_no_state_until_it_pushes_again() -> None:
    clock = Clock()
    store = RowStore(clock=clock)
    store.put(_row())
    clock.now += SILENT_AFTER_S
    assert store.rows(["decode-0"]) == [_row()]   # within the bound: its last row as pushed
    clock.now += 0.5
    silent = store.rows(["decode-0"])[0]
    assert (silent.state, silent.pid, silent.kv) == (None, None, None)
    assert silent.error == (f"no report from its supervisor for {SILENT_AFTER_S + 0.5:.0f}s (dead or hung); "
                            f"its last report: READY, pid 42")
    assert (silent.restarts, silent.history) == (1, _row().history)
    store.put(_row(at=9.0))
    assert store.rows(["decode-0"]) == [_row(at=9.0)]


def test_a_supervisor_that_never_reports_is_shown_silent_after_the_bound() -> None:
    clock = Clock()
    store = RowStore(clock=clock)
    store.expect(_row(state=None, pid=None, kv=None, at=None, error="its supervisor has not reported yet"))
    clock.now += SILENT_AFTER_S + 1
    row = store.rows(["decode-0"])[0]
    assert row.state is None and row.error == (f"no report from its supervisor for {SILENT_AFTER_S + 1:.0f}s "
                                               f"(dead or hung); its supervisor has not reported yet")
