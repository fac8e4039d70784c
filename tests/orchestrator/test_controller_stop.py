"""The controller's `stop` racing its own `up`: an interrupted `up` asks the controller to stop while another of its
threads is still starting supervisors. A fake Ray records every supervisor actor made and killed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dsv4_cluster.orchestrator.errors import ClusterStartError
from dsv4_cluster.orchestrator.launch.plan import cluster_plans
from dsv4_cluster.orchestrator.supervise import controller as ctl
from dsv4_cluster.orchestrator.topology.load import load_topology

REPO = Path(__file__).resolve().parents[2]


class _Call:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class _Actor:
    def __init__(self, name: str) -> None:
        self.name, self.killed = name, False
        self.stop = _Call(lambda deadline_s: name)


class _FakeRay:
    def __init__(self) -> None:
        self.made: list[_Actor] = []
        self.on_kill: Callable[[], None] | None = None

    def remote(self, cls: Any) -> Any:
        def options(**kw: Any) -> Any:
            def make(*args: Any, **kwargs: Any) -> _Actor:
                self.made.append(_Actor(kw["name"]))
                return self.made[-1]
            return _Call(make)
        return SimpleNamespace(options=options)

    def kill(self, actor: _Actor) -> None:
        actor.killed = True
        hook, self.on_kill = self.on_kill, None
        if hook is not None:
            hook()

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        return ref

    def get_actor(self, name: str, namespace: str) -> Any:
        raise ValueError(name)  # a new cluster: no supervisor to take over

    def get_runtime_context(self) -> Any:
        return SimpleNamespace(current_actor=None)

    def nodes(self) -> list[Any]:
        return []


class _Server:
    def __init__(self, *args: Any) -> None:
        pass

    start = stop = lambda self: None


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _FakeRay, Any]:
    fake_ray = _FakeRay()
    for name, value in [("ray", fake_ray), ("StatusServer", _Server), ("write_actor_record", lambda *a: None),
                        ("current_actor_id", lambda: "actor"), ("record_targets", lambda *a: None),
                        ("listed", lambda run_dir: set())]:
        monkeypatch.setattr(ctl, name, value)
    workers, router = cluster_plans(load_topology(REPO / "examples" / "local.yaml"))
    spec = ctl.ClusterSpec(namespace="t", endpoint="http://127.0.0.1:1/v1", workers=tuple(workers), router=router,
                           node_addresses=(("local", "127.0.0.1"),))
    controller = ctl.ClusterController(spec)
    for plan in workers:   # `up` has started the workers, and is about to start the router
        controller._supervisor(plan)
    return controller, fake_ray, router


def test_a_supervisor_up_starts_while_stop_kills_is_refused_and_stop_finishes(fake) -> None:
    """Seen in a review: SIGTERM during `up` made `stop` fail with 'dictionary changed size during iteration' when
    `up` added the router's supervisor as `stop` killed the workers'."""
    controller, fake_ray, router = fake
    refused: list[Exception] = []

    def up_starts_the_router() -> None:
        try:
            controller._supervisor(router)
        except ClusterStartError as e:
            refused.append(e)

    fake_ray.on_kill = up_starts_the_router
    assert controller.stop(deadline_s=1.0) == []
    assert [str(e) for e in refused] == ["router: not started, the cluster is being stopped"]
    assert [a.name for a in fake_ray.made if not a.killed] == []


def test_no_supervisor_is_made_once_stop_ran(fake) -> None:
    """`up`'s thread going on after `stop` returned would leave a detached supervisor (and its router) running."""
    controller, fake_ray, router = fake
    controller.stop(deadline_s=1.0)
    with pytest.raises(ClusterStartError, match="being stopped"):
        controller._supervisor(router)
    assert [a.name for a in fake_ray.made if not a.killed] == []
