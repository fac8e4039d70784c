"""Every test process is a driver of loopback Ray clusters only: set Ray's environment before any test
module imports `ray` (Ray reads it once, at import; `orchestrator/cluster/ray_env.py` says why).

Parallel test workers (`pytest -n`) each search their own slice of ports, as do the processes they start: a port
one worker found free and had not bound yet was once picked by the other too (a prefill that could not bind its
port crash-looped, and `up` failed).

Without a CUDA device, Triton runs through its interpreter: TRITON_INTERPRET is read when a @triton.jit function is
defined, so it is set here, before any test module of any folder imports a kernel module (a bench test that imported
one at collection, before the kernel tests' folder was reached, made every interpreter test of its worker fail).

One OpenMP thread per process, for this process and every process it starts (set before torch loads OpenMP): the
suite runs two test processes beside the clusters they start, on as few as two cores, and torch's default of one
thread per core had its idle threads spin for cores the others needed (the kernel-path tests took 66 CPU-seconds
with the default, 26 with one thread). The embedded workers already run one thread each (`workers/http/server.py`)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv4_cluster.orchestrator.cluster.ray_env import prepare_ray_env
from dsv4_cluster.orchestrator.launch.ports import EPHEMERAL_LOW, PORTS_ENV, SEARCH_LOW
from tests import servers

if TYPE_CHECKING:
    from bench.local_cluster import LocalCluster

prepare_ray_env(None)


def _slice(low: int, high: int) -> tuple[int, int]:
    """This xdist worker's share of [low, high) (all of it outside xdist)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = (high - low) // max(count, 1)
    return low + index * size, low + (index + 1) * size


_LOW, _HIGH = _slice(SEARCH_LOW, EPHEMERAL_LOW)
os.environ[PORTS_ENV] = f"{_LOW}-{_HIGH}"
servers.PORT_RANGE = (_LOW, _HIGH - 1)   # the test servers' ports too (inclusive bounds), above Ray's worker ports


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., AbstractContextManager[LocalCluster]]:
    """The embedded cluster the end-to-end modules bring up: `with local_cluster(name, **topology) as c:` writes
    `bench.local_cluster.write_topology(<fresh temp folder name>, **topology)`, `up`s it and `down`s it when the block
    ends (`LocalCluster.running`: both asserted). Each module's own `cluster` fixture calls it with its topology,
    in its own scope."""
    from bench.local_cluster import write_topology   # here: the GPU runs import this file without the CLI's needs

    def start(name: str, **topology: Any) -> AbstractContextManager[LocalCluster]:
        return write_topology(tmp_path_factory.mktemp(name), **topology).running()
    return start


@pytest.fixture
def plans_on(monkeypatch):
    """`plan_launch` as on a GPU of the class given, without one: the class and Gluon's API patched, the answers
    cached for this process's real device cleared before and after."""
    from dsv4_cluster.kernels import dispatch
    from dsv4_cluster.kernels.sparse_mla_decode import config as cfg_mod
    from dsv4_cluster.kernels.sparse_mla_decode import plan as plan_mod

    def clear():
        for cached in (cfg_mod._choose, cfg_mod.choose_backend_for, plan_mod.plan_launch):
            cached.cache_clear()

    def on(gpu: str):
        monkeypatch.setattr(dispatch, "class_of_device", lambda device: gpu)
        monkeypatch.setattr(cfg_mod, "gluon_api_unavailable", lambda: None)
        clear()
        return plan_mod.plan_launch

    yield on
    clear()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that start real clusters (any test marked `slow`) first, the rest after them, each module's tests
    in their order: `-n 2 --dist loadfile` hands whole modules to the two test processes in this order, and with a
    cluster module (up to ~4 minutes of one core) among the last, the other core sat idle while it finished."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)
