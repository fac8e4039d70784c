"""What the CLI says and does while it watches and drains. `up --foreground`'s watch reads the controller's status
endpoint and stays out of Ray while it answers: ray.init installs a SIGTERM handler that kills the process on
whichever thread the signal lands on (torch's included), so a systemd stop inside the watch's connect left the cluster
running."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from dsv4_cluster.core import ClusterStatus, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.cluster import deployment
from dsv4_cluster.orchestrator.errors import NotUpError
from dsv4_cluster.orchestrator.supervise.status_endpoint import EndpointUnavailable


def _status(state: WorkerState, error: str | None = None) -> ClusterStatus:
    row = WorkerStatus(name="decode-0", role=Role.DECODE, node="n", state=state, pid=1, port=1, restarts=0, kv=None,
                       log_path="x.log", error=error)
    return ClusterStatus(endpoint="http://localhost:30001/v1", workers=(row,))


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The recorded cluster: endpoint replies from `replies` (an exception is raised), Ray calls counted."""
    seen = SimpleNamespace(replies=[], ray_calls=0, stop=threading.Event())

    def read_status(run_dir: str) -> ClusterStatus:
        reply = seen.replies.pop(0) if seen.replies else _status(WorkerState.READY)
        if not seen.replies:
            seen.stop.set()   # the last reply served: the next wait sees SIGTERM's event
        if isinstance(reply, Exception):
            raise reply
        return reply

    def find_controller(record: object) -> object:
        seen.ray_calls += 1
        raise NotUpError("the cluster is gone (asked through Ray)")

    monkeypatch.setattr(deployment, "read_record", lambda: SimpleNamespace(run_dir="/nowhere"))
    monkeypatch.setattr(deployment, "read_status", read_status)
    monkeypatch.setattr(deployment, "find_controller", find_controller)
    return seen


def test_watch_stays_out_of_ray_while_the_endpoint_answers(cluster: SimpleNamespace) -> None:
    cluster.replies = [_status(WorkerState.READY)] * 3
    assert deployment.watch(0.001, cluster.stop) is None
    assert cluster.ray_calls == 0   # the previous watch connected to Ray first, and held the connection


def test_watch_names_a_failed_worker_from_the_endpoint(cluster: SimpleNamespace) -> None:
    cluster.replies = [_status(WorkerState.READY), _status(WorkerState.FAILED, "exited 1 four times\nmore")]
    assert deployment.watch(0.001, cluster.stop) == "decode-0 is FAILED: exited 1 four times"
    assert cluster.ray_calls == 0


def test_watch_asks_ray_only_when_the_endpoint_does_not_answer(cluster: SimpleNamespace) -> None:
    cluster.replies = [_status(WorkerState.READY), EndpointUnavailable("no status endpoint recorded")]
    assert deployment.watch(0.001, cluster.stop) == "the cluster is gone (asked through Ray)"
    assert cluster.ray_calls == 1


@pytest.mark.parametrize("drained, said", [
    ((0, 0, 0.0), "(no request in flight)"),
    ((0, 3, 8.64), "(its 3 request(s) in flight finished in 8.6s)"),   # it said "no request in flight"
    ((2, 5, 60.0), "(forced after 60s with 2 request(s) in flight)"),
])
def test_drain_says_what_it_waited_for(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                       drained: tuple[int, int, float], said: str) -> None:
    from dsv4_cluster.orchestrator.cli.ops import run_operation
    from dsv4_cluster.orchestrator.cluster import operations
    from dsv4_cluster.orchestrator.supervise.controller import Drained

    monkeypatch.setattr(operations, "drain", lambda *_: Drained(_status(WorkerState.STOPPED).workers[0], *drained))
    args = SimpleNamespace(command="drain", worker="decode-0", deadline=60.0, timeout=30.0)
    assert run_operation(args) == (1 if drained[0] else 0)
    assert f"decode-0 drained and stopped {said}" in capsys.readouterr().out
