"""The `up`, `status` and `down` sequences the CLI runs.

`up`: validate -> plan -> preflight (before anything starts) -> start or join Ray -> the detached controller
starts the supervisors and waits for READY -> record the cluster. `down`: stop everything through the controller,
stop the Ray head only if `up` started it, check by pid that nothing is left, forget the record.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dsv4_cluster.core import ClusterStatus, WorkerState
from dsv4_cluster.orchestrator.cluster import ray_cluster
from dsv4_cluster.orchestrator.supervise.controller import (
    ACTOR_MAX_RESTARTS, CONTROLLER_NAME, READ_RETRIES, STOPPED_BY_DOWN, ClusterController, ClusterSpec, cause_text,
    cluster_identity, supervisor_name)
from dsv4_cluster.orchestrator.errors import (
    CLEAN_UP, AlreadyUpError, ClusterStartError, ForeignControllerError, NotUpError, PreflightError, RayClusterError)
from dsv4_cluster.orchestrator.cluster.options import DownOptions, UpOptions
from dsv4_cluster.orchestrator.launch.plan import cluster_plans, endpoint, requested_kernels
from dsv4_cluster.orchestrator.processes import group_members, pid_alive, signals_held, stop_on_signals
from dsv4_cluster.orchestrator.launch.preflight import preflight
from dsv4_cluster.orchestrator.cluster.record import (
    ClusterRecord, RecordError, clear_record, read_record, write_record)
from dsv4_cluster.orchestrator.supervise.router_admin import new_admin_token, with_admin_token
from dsv4_cluster.orchestrator.topology.load import TopologyError, load_topology
from dsv4_cluster.orchestrator.supervise.status_endpoint import EndpointUnavailable, predicted_capacity, read_status
from dsv4_cluster.orchestrator.verify.sequence import VerifyReport, verify_cluster

CONTROLLER_CONCURRENCY = 8
logger = logging.getLogger(__name__)


def _spec(topology: Any, admin_token: str, new_head: bool) -> ClusterSpec:
    workers, router = cluster_plans(topology)
    plans = [*workers, router]
    problems = preflight(topology, plans) + (ray_cluster.beyond_a_new_head(topology, plans) if new_head else [])
    if problems:
        raise PreflightError(problems)
    return ClusterSpec(
        namespace=topology.cluster.namespace, endpoint=endpoint(topology), workers=tuple(workers),
        router=with_admin_token(router, admin_token),
        node_addresses=tuple((n.name, n.address) for n in topology.nodes),
        kernels=requested_kernels(topology), admin_token=admin_token,
        kv_predicted=tuple(predicted_capacity(topology).items()),
    )


def _existing_cluster() -> ClusterRecord | None:
    try:
        record = read_record()
    except RecordError:
        return None
    if record.head is not None and not ray_cluster.head_alive(record.head):
        clear_record()  # its head is gone, and the processes died with it
        return None
    return record


def up(topology_path: str, options: UpOptions) -> UpResult:
    """Bring the cluster up; returns its status. Up again with the same topology file while it
    runs starts nothing and returns its status with `already_up`. Raises TopologyError and
    PreflightError before anything starts, ClusterStartError after cleaning up what it started."""
    topology = load_topology(topology_path)
    existing = _existing_cluster()
    if existing is not None:
        if Path(existing.topology_path).resolve() == Path(topology_path).resolve():   # the same file, any spelling
            try:
                return UpResult(status(), already_up=True)  # `up` again is a no-op that reports
            except NotUpError as e:
                raise AlreadyUpError(f"a cluster from {topology_path} is recorded but does not answer "
                                     f"({e}); run `dsv4-cluster down` first") from e
        raise AlreadyUpError(f"a cluster is already up ({existing.topology_path}, "
                             f"{existing.endpoint}); run `dsv4-cluster down` first")
    admin_token = new_admin_token()
    address = options.address or topology.cluster.address
    spec = _spec(topology, admin_token, new_head=address is None)
    run_dir = topology.run_dir_path
    head = None
    _INTERRUPTED.clear()
    _interrupt_on_sigterm()
    if address is None:
        reserved = frozenset(port for plan in (*spec.workers, spec.router) for port in plan.ports)
        address, head = ray_cluster.start_head(run_dir / "logs" / "ray-head.log", None,
                                               options.head_timeout_s, reserved)
    record = ClusterRecord(address=address, namespace=spec.namespace, endpoint=spec.endpoint,
                           topology_path=str(Path(topology_path).absolute()),
                           run_dir=str(run_dir), head=head, admin_token=admin_token)
    controller = None
    try:
        _check_interrupt()       # a signal while the head started: stop it (below)
        with signals_held():     # ray.init installs Ray's SIGTERM handler, which exits: a signal waits for ours
            ray_cluster.connect(address, spec.namespace)
            _interrupt_on_sigterm()  # again: ray.init replaced it
        _check_interrupt()
        _refuse_second_controller(spec.namespace)
        write_record(record)
        controller = ray.remote(ClusterController).options(
            name=CONTROLLER_NAME, namespace=spec.namespace, lifetime="detached", num_cpus=0,
            max_concurrency=CONTROLLER_CONCURRENCY, max_restarts=ACTOR_MAX_RESTARTS).remote(spec)
        try:
            started = ray.get(controller.up.remote(options.timeout_s))
        except (RayTaskError, RayActorError) as e:
            raise ClusterStartError(_start_failure(e)) from e
        _check_interrupt()
        verification = _verify(topology, started, controller)
        _check_interrupt()
        return UpResult(started, verification=verification)
    except BaseException as e:
        if controller is not None:
            _abandon(controller, spec)
        ray_cluster.disconnect()
        if head is not None:
            ray_cluster.stop_head(head, deadline_s=10.0)
        clear_record()
        if isinstance(e, KeyboardInterrupt) and not str(e) and _INTERRUPTED:   # ray.get raises a bare one
            raise KeyboardInterrupt(f"signal {_INTERRUPTED[-1]} during up") from e
        raise
    finally:
        ray_cluster.disconnect()


def _start_failure(err: BaseException) -> str:
    """Why the controller's `up` ended without a cluster. Only `down` kills the controller while `up` waits on it
    (Ray's death text says `ray.kill`): said in our words, as the controller says it when its `up` sees the stop first
    (Ray's text named the actor's class, id and pid)."""
    if isinstance(err, RayActorError) and "ray.kill" in str(err):
        return STOPPED_BY_DOWN
    return cause_text(err)


def _verify(topology: Any, status: ClusterStatus, controller: Any) -> str:
    """End-to-end check once everything is READY (`verify/sequence.py`); raises ClusterStartError on failure, in our
    words when `down` stopped the cluster meanwhile (the checks' requests then fail on its closed ports)."""
    report = verify_cluster(topology, status.pids())
    if report.ok:
        return report.summary()
    try:
        stopped = ray.get(controller.stopping.remote(), timeout=30)
    except (RayTaskError, RayActorError, GetTimeoutError) as e:
        stopped = _start_failure(e) == STOPPED_BY_DOWN   # `down` kills the controller once it stopped the rest
    raise ClusterStartError(STOPPED_BY_DOWN if stopped else report.summary())


def verify() -> VerifyReport:
    """`dsv4-cluster verify`: the same checks against the cluster that is up now."""
    record = _existing_cluster()
    if record is None:
        raise NotUpError("no cluster is up (no record of one)")
    return verify_cluster(load_topology(record.topology_path), status().pids())


_INTERRUPTED: list[str] = []  # the signals that arrived during this `up`


def _raise_interrupt(signum: int, frame: Any) -> None:
    _INTERRUPTED.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(f"signal {_INTERRUPTED[-1]} during up")


def _check_interrupt() -> None:
    """Raise the interrupt again if the handler's raise was lost: Python ignores (prints and drops) an exception
    raised in a weakref callback or __del__, and the signal can land there. Seen in CI: SIGTERM arrived inside
    importlib's module-lock callback, `up` went on, brought the cluster up and exited 0."""
    if _INTERRUPTED:
        raise KeyboardInterrupt(f"signal {_INTERRUPTED[-1]} during up")


def _interrupt_on_sigterm() -> None:
    """SIGTERM during `up` stops what `up` started (ray.init installed a handler that just dies)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _abandon(controller: Any, spec: ClusterSpec) -> None:
    """Stop whatever a failed or interrupted `up` left running, then the controller itself."""
    try:
        ray.get(controller.stop.remote(10.0), timeout=60)
    except (RayTaskError, RayActorError, GetTimeoutError) as e:
        # Killing the supervisors kills their processes (PR_SET_PDEATHSIG). A controller `down` killed left none.
        killed = kill_supervisors(spec.namespace, [p.name for p in (*spec.workers, spec.router)])
        if killed:
            gone = "is gone" if isinstance(e, RayActorError) else f"did not stop them ({cause_text(e)})"
            logger.warning("stopping the processes of a failed up: the controller %s; killed the supervisors of %s",
                           gone, ", ".join(killed))
    ray.kill(controller)


def kill_supervisors(namespace: str, workers: list[str]) -> list[str]:
    """Kill the named supervisor actors of `workers` (their processes die with them): for a gone controller's."""
    found = []
    for worker in workers:
        try:
            actor = ray.get_actor(supervisor_name(worker), namespace=namespace)
        except ValueError:
            continue
        ray.kill(actor)
        found.append(worker)
    return found


def _refuse_second_controller(namespace: str) -> None:
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return
    raise AlreadyUpError(f"Ray namespace {namespace!r} already has a controller; run "
                         "`dsv4-cluster down` or pick another cluster.namespace")


def find_controller(record: ClusterRecord) -> Any:
    """The cluster's controller actor (connects to its Ray cluster; the caller disconnects). A Ray head `up` started
    must still run: once it died, another Ray head may listen at its address (another cluster `up` started picks any
    free port), and its namespace's controller is not this cluster's."""
    if record.head is not None and not ray_cluster.head_alive(record.head):
        raise NotUpError(f"the Ray head `up` started for {record.topology_path} (pid {record.head.pid}) is gone, and "
                         f"the cluster with it{CLEAN_UP}")
    ray_cluster.connect(record.address, record.namespace)
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=record.namespace)
    except ValueError:
        raise NotUpError(f"no controller in Ray namespace {record.namespace!r} at {record.address}; the cluster is "
                         f"gone{CLEAN_UP}") from None
    # once this cluster's controller died for good, another cluster may have come up in the same namespace of the
    # same Ray cluster: its controller answers to the name, and must be neither reported nor stopped as this one
    if record.admin_token is not None and cluster_identity(record.admin_token) != ray.get(
            controller.identity.options(max_task_retries=READ_RETRIES).remote(), timeout=60):
        raise ForeignControllerError(
            f"the controller in Ray namespace {record.namespace!r} at {record.address} belongs to another cluster "
            f"(not the one `up` started from {record.topology_path}, which is gone); run `dsv4-cluster down` to "
            "forget this one: it stops nothing of the other")
    return controller


def status() -> ClusterStatus:
    """The recorded cluster's status, through Ray."""
    record = read_record()
    try:
        controller = find_controller(record)
        return ray.get(controller.status.options(max_task_retries=READ_RETRIES).remote(), timeout=60)
    except (RayActorError, GetTimeoutError) as e:
        raise NotUpError(f"the controller does not answer: {e}") from e
    except RayClusterError as e:
        raise NotUpError(f"the cluster from {record.topology_path} is gone ({e}){CLEAN_UP}") from e
    finally:
        ray_cluster.disconnect()


def watch(interval_s: float, stop: threading.Event) -> str | None:
    """Block until SIGTERM/SIGINT set `stop` (None; the caller installed its handlers), or until the controller stops
    answering or a worker is FAILED (why). It reads the controller's status endpoint, so this process stays out of
    Ray (whose ray.init installs a SIGTERM handler that kills the process, on any thread the signal lands on); Ray is
    asked only while the endpoint does not answer (the controller restarting)."""
    record = read_record()
    while not stop.wait(interval_s):
        try:
            current = read_status(record.run_dir)
        except EndpointUnavailable:
            try:
                current = _status_through_ray(record, stop)
            except (RayActorError, GetTimeoutError) as e:
                return f"the controller does not answer: {e}"
            except (NotUpError, RayClusterError) as e:
                return str(e)
        failed = [w for w in current.workers if w.state is WorkerState.FAILED]
        if failed:
            return "; ".join(f"{w.name} is FAILED: {(w.error or '').splitlines()[0]}" for w in failed)
    return None


def _status_through_ray(record: ClusterRecord, stop: threading.Event) -> ClusterStatus:
    try:
        with signals_held():    # ray.init installs Ray's handlers: a signal waits for ours, put back after it
            try:
                controller = find_controller(record)
            finally:
                stop_on_signals(stop)
        return ray.get(controller.status.options(max_task_retries=READ_RETRIES).remote(), timeout=60)
    finally:
        ray_cluster.disconnect()


def _wait_gone(pids: list[int], deadline_s: float) -> list[int]:
    end = time.monotonic() + deadline_s
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


def _kill_orphaned_supervisors(record: ClusterRecord) -> list[str]:
    """Supervisors outlive their controller (detached): kill those the topology names, if Ray answers."""
    if not ray.is_initialized():
        return []  # no Ray cluster to look in (its head is gone, and the actors with it)
    try:
        names = [w.name for w in load_topology(record.topology_path).workers] + ["router"]
        killed = kill_supervisors(record.namespace, names)
    except (TopologyError, RayClusterError, RayActorError) as e:
        return [f"supervisors: not looked for ({e})"]
    return [f"supervisors killed without their controller: {', '.join(killed)}"] if killed else []


@dataclass(frozen=True)
class UpResult:
    status: ClusterStatus
    already_up: bool = False  # `up` again with the same topology: nothing was started
    verification: str | None = None  # the verification's summary


@dataclass(frozen=True)
class DownResult:
    survivors: list[int]  # pids still running after the deadline
    notes: list[str]  # what did not go as planned


def down(options: DownOptions) -> DownResult:
    """Stop everything `up` started; returns what survived."""
    record = read_record()
    notes: list[str] = []
    pids: list[int] = []
    try:
        controller = find_controller(record)
        here = socket.gethostname()  # a remote node's supervisor checks its own process group
        pids = [pid for host, pid in ray.get(controller.pids.remote(), timeout=60) if host == here]
        notes += ray.get(controller.stop.remote(options.timeout_s), timeout=options.timeout_s + 60)
        ray.kill(controller)
    except ForeignControllerError as e:
        notes.append(f"controller: {e}")   # the namespace is another cluster's now: its supervisors are not ours
    except (NotUpError, RayClusterError, RayActorError, GetTimeoutError) as e:
        notes.append(f"controller: {str(e).removesuffix(CLEAN_UP)}")   # this is that `down`
        notes += _kill_orphaned_supervisors(record)
    finally:
        ray_cluster.disconnect()
    if record.head is not None:
        ray_cluster.stop_head(record.head, options.timeout_s)
    survivors = _wait_gone(pids, options.timeout_s)
    if record.head is not None:
        survivors += group_members(record.head.pid)
    clear_record()
    return DownResult(survivors, notes)
