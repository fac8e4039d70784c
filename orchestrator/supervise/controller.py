"""The controller: one detached, named Ray actor that owns the cluster's supervisors.

It places one supervisor per worker on the worker's node, starts prefill and decode concurrently and the router
once every worker is READY, runs the deep probe, and answers `GET /status/<key>` on loopback (`status_endpoint.py`)
from the rows the supervisors push to it (`row_store.py`): reading status asks no supervisor.
Ray restarts it (`max_restarts`); the new one takes over the running supervisors by name, which outlive it (and
asks each for its row once), so `stop` kills them by name (deployment's `kill_supervisors` for a controller that is
gone).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import ray
from ray.exceptions import RayActorError, RayTaskError

from dsv4_cluster.orchestrator.supervise.actor_record import (
    ActorRecord, current_actor_id, record_path, write_actor_record)
from dsv4_cluster.orchestrator.cluster.ray_cluster import ray_node_ip
from dsv4_cluster.orchestrator.errors import ClusterStartError, UnknownWorkerError
from dsv4_cluster.core import ClusterStatus, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.verify.deep_probe import DeepProber
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.supervise.status_endpoint import StatusServer, with_predicted_capacity
from dsv4_cluster.orchestrator.monitor.targets import listed, record_targets
from dsv4_cluster.orchestrator.supervise.router_admin import (
    RouterAdmin, RouterAdminError, RouterLink, reason_line)
from dsv4_cluster.orchestrator.supervise.row_store import RowStore
from dsv4_cluster.orchestrator.supervise.start_wait import cause_text, wait_started
from dsv4_cluster.orchestrator.supervise.status_push import ControllerSink
from dsv4_cluster.orchestrator.supervise.supervisor import WorkerSupervisor
from dsv4_cluster.orchestrator.verify.sequence import verify_kernels

CONTROLLER_NAME = "controller"
NODE_RESOURCE_SHARE = 0.001  # a sliver of a node's placement resource pins an actor to it
NODE_LABEL_PREFIX = "dsv4-node:"  # `ray start --resources '{"dsv4-node:<name>": 1}'` names a node
SUPERVISOR_CONCURRENCY = 4  # start() blocks while status()/stop() must still answer
DEEP_PROBE_INTERVAL_S = 30.0
DRAIN_POLL_S = 0.2
ACTOR_MAX_RESTARTS = -1  # Ray restarts a dead controller or supervisor for as long as the cluster is up
READ_RETRIES = 2  # status/pids are safe to send again to an actor Ray restarted
TAKE_OVER_WAIT_S = 5.0  # a restarted controller's wait for the rows it asks of the running supervisors


def cluster_identity(admin_token: str | None) -> str | None:
    """A digest of a cluster's admin token: unique per `up`, and safe to pass through Ray."""
    return None if admin_token is None else hashlib.sha256(admin_token.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ClusterSpec:
    """Everything the controller needs, computed by the CLI from the topology."""

    namespace: str
    endpoint: str
    workers: tuple[LaunchPlan, ...]
    router: LaunchPlan
    node_addresses: tuple[tuple[str, str], ...]  # (node name, address)
    kernels: tuple[str, ...] = ()  # requested; every worker must report each one active
    admin_token: str | None = field(default=None, repr=False)  # the router's, for its admin API
    probe_interval_s: float = DEEP_PROBE_INTERVAL_S
    kv_predicted: tuple[tuple[str, int], ...] = ()  # (worker, predicted KV tokens), added to its status row


@dataclass(frozen=True)
class Drained:
    """A drained worker: its final row, the requests still in flight when it was stopped (0 unless forced), those in
    flight when the drain began, and how long it waited for them."""

    worker: WorkerStatus
    in_flight_at_stop: int
    in_flight_at_start: int = 0
    waited_s: float = 0.0

    @property
    def forced(self) -> bool:
        return self.in_flight_at_stop > 0


STOPPED_BY_DOWN = "`dsv4-cluster down` stopped the cluster while it was starting"


class ClusterController:
    """Creates, starts, reports on and stops every supervised process of one cluster."""

    def __init__(self, spec: ClusterSpec) -> None:
        self._spec = spec
        self._supervisors: dict[str, Any] = {}
        self._rows = RowStore()
        self._prober: DeepProber | None = None
        self._targets_lock = threading.Lock()  # drain, restart and stop may run concurrently (max_concurrency)
        self._supervisors_lock, self._stopping = threading.Lock(), False  # once `stop` set it, no new supervisor
        self._stopped = self._names()  # stopped on purpose: not scrape targets
        write_actor_record(record_path(spec.router.cwd, CONTROLLER_NAME), ActorRecord(current_actor_id(), os.getpid()))
        self._take_over()
        self._status_server = StatusServer(self.status, spec.router.cwd)  # `dsv4-cluster status` asks it, no Ray
        self._status_server.start()

    def _take_over(self) -> None:
        """After Ray restarted this controller: adopt the supervisors still running (by name), and
        start the deep probe again once the router is among them. In a new cluster there are none."""
        for plan in (*self._spec.workers, self._spec.router):
            try:
                self._adopt(plan, ray.get_actor(supervisor_name(plan.name), namespace=self._spec.namespace))
            except ValueError:
                continue
        if self._supervisors:   # the targets files say which of them were stopped on purpose
            self._stopped -= listed(self._spec.router.cwd)
        asked = [a.status.remote() for a in self._supervisors.values()]  # their pushes come too, but later
        answered = ray.wait(asked, num_returns=len(asked), timeout=TAKE_OVER_WAIT_S)[0] if asked else []
        for ref in answered:
            try:
                self._rows.put(ray.get(ref))
            except (RayTaskError, RayActorError):
                continue  # a supervisor that is itself restarting: it announces itself when it is back
        if self._spec.router.name in self._supervisors:
            self._prober = DeepProber(self._spec.workers, self._spec.probe_interval_s, ready=self._ready)
            self._prober.start()

    def _node_resource(self, node: str) -> str:
        """The Ray resource that places an actor on topology node `node`: `dsv4-node:<name>` when the Ray cluster's
        nodes carry such labels (several Ray nodes may share an address, e.g. on one machine), else Ray's built-in
        `node:<ip>` of the node's address (a hostname resolved: Ray names its nodes by IP)."""
        labelled = {r for n in ray.nodes() if n.get("Alive") for r in n.get("Resources", {})
                    if r.startswith(NODE_LABEL_PREFIX)}
        if labelled:
            return NODE_LABEL_PREFIX + node
        return f"node:{ray_node_ip(dict(self._spec.node_addresses)[node])}"

    def _missing_nodes(self) -> list[str]:
        """One line per process whose node is not (alive) in the Ray cluster."""
        alive = [n for n in ray.nodes() if n.get("Alive")]
        have = {r for n in alive for r in n.get("Resources", {})}
        addresses = dict(self._spec.node_addresses)
        problems = []
        for p in (*self._spec.workers, self._spec.router):
            resource = self._node_resource(p.node)
            if resource in have:
                continue
            if resource.startswith(NODE_LABEL_PREFIX):
                problems.append(f"{p.name}: node {p.node!r} is not in the Ray cluster (no Ray node has the "
                                f"resource {resource!r}); on that machine run `ray start --address <head> "
                                f"--resources '{{\"{resource}\": 1}}'`")
            else:
                problems.append(
                    f"{p.name}: node {p.node!r} ({addresses[p.node]}) is not in the Ray cluster (its nodes: "
                    f"{', '.join(sorted(n['NodeManagerAddress'] for n in alive))}); on that machine run "
                    f"`ray start --address <head> --node-ip-address {addresses[p.node]}`, or fix nodes[].address")
        return problems

    def _adopt(self, plan: LaunchPlan, actor: Any) -> None:
        """`actor` supervises `plan`'s process: its row is shown from now on, first as not reported yet."""
        self._rows.expect(WorkerStatus(plan.name, plan.role, plan.node, None, None, plan.port, 0, None,
                                       plan.log_path, error="its supervisor has not reported yet"))
        self._supervisors[plan.name] = actor

    def _supervisor(self, plan: LaunchPlan) -> Any:
        link = None
        if plan.role is not Role.ROUTER and self._spec.admin_token is not None:
            link = RouterLink.for_router(self._spec.router, self._spec.admin_token)
        report = ControllerSink(ray.get_runtime_context().current_actor)  # rows pushed to this actor's `report`
        with self._supervisors_lock:   # an interrupted `up` stops the cluster while `up` still starts processes
            if self._stopping:
                raise ClusterStartError(f"{plan.name}: not started, the cluster is being stopped")
            actor = ray.remote(WorkerSupervisor).options(
                name=supervisor_name(plan.name), namespace=self._spec.namespace, lifetime="detached",
                max_restarts=ACTOR_MAX_RESTARTS, num_cpus=0, max_concurrency=SUPERVISOR_CONCURRENCY,
                resources={self._node_resource(plan.node): NODE_RESOURCE_SHARE},
            ).remote(plan, router=link, report=report)
            self._adopt(plan, actor)
        return actor

    def _start_all(self, plans: list[LaunchPlan], timeout_s: float) -> list[str]:
        rows, failures = wait_started({p.name: self._supervisor(p).start.remote(timeout_s) for p in plans})
        for row in rows:
            self._rows.put(row)
        return failures

    def up(self, timeout_s: float) -> ClusterStatus:
        """Start workers, verify them, then start the router; on any failure stop everything
        and raise ClusterStartError listing every problem."""
        failures = self._missing_nodes()
        if not failures:
            failures = self._start_all(list(self._spec.workers), timeout_s)
        if not failures:
            failures = verify_kernels(self._spec.workers, self._spec.kernels, self._pids())
        if not failures:
            failures = self._start_all([self._spec.router], timeout_s)
        if failures:
            stopped_by_down = self._stopping   # a stop from outside (`down`) while starting, not a failure
            self.stop(deadline_s=10.0)
            raise ClusterStartError(STOPPED_BY_DOWN if stopped_by_down
                                    else "the cluster did not come up:\n" + "\n".join(failures))
        self._set_targets(started=self._names())
        status = self.status()  # read before the deep probe starts: its request in flight would show as KV in use
        self._prober = DeepProber(self._spec.workers, self._spec.probe_interval_s, ready=self._ready)
        self._prober.start()
        return status

    def _names(self) -> set[str]:
        return {p.name for p in (*self._spec.workers, self._spec.router)}

    def _set_targets(self, stopped: Iterable[str] = (), started: Iterable[str] = ()) -> None:
        """Prometheus follows what this controller starts and stops on purpose (never a status read)."""
        with self._targets_lock:
            self._stopped = (self._stopped | set(stopped)) - set(started)
            record_targets(self._spec, self._stopped)

    def _pids(self) -> dict[str, int | None]:
        """Each supervised process's pid (None when not running), for the kernel attestations."""
        return self.status().pids()

    def report(self, row: WorkerStatus) -> None:
        """A supervisor's push: its row now (kept unless a row it read later is here already)."""
        self._rows.put(row)

    def status(self) -> ClusterStatus:
        """Every supervised process's latest pushed row, in start order, and the deep probes: no call to any
        supervisor, and reading it writes nothing. A supervisor silent too long shows no state (`row_store.py`)."""
        names = [p.name for p in self._spec.workers] + [self._spec.router.name]
        supervised = dict(self._supervisors)
        predicted = dict(self._spec.kv_predicted)
        rows = [with_predicted_capacity(r, predicted) for r in self._rows.rows(n for n in names if n in supervised)]
        probes = self._prober.results() if self._prober is not None else ()
        return ClusterStatus(self._spec.endpoint, tuple(rows), probes)

    def _worker(self, name: str, router: bool = False) -> tuple[LaunchPlan, Any]:
        """A worker's plan and supervisor (or the router's, when `router` allows it)."""
        plans = {p.name: p for p in [*self._spec.workers, *([self._spec.router] if router else [])]}
        if name not in plans or name not in self._supervisors:
            raise UnknownWorkerError(f"no {'process' if router else 'worker'} named {name!r}; this cluster has "
                                     f"{sorted(plans)}" + ("" if router else " (the router is not drained)"))
        return plans[name], self._supervisors[name]

    def _ready(self, name: str) -> bool:
        return any(row.state is WorkerState.READY for row in self._rows.rows([name]))

    def _admin(self) -> RouterAdmin:
        if self._spec.admin_token is None:
            raise RouterAdminError("this cluster was started without a router admin token")
        return RouterAdmin(RouterLink.for_router(self._spec.router, self._spec.admin_token))

    def drain(self, name: str, deadline_s: float, stop_deadline_s: float) -> Drained:
        """Stop pairing `name`, wait until its in-flight requests are done (at most `deadline_s`),
        then stop it (SIGTERM, SIGKILL after `stop_deadline_s`). Raises RouterAdminError when the
        router cannot be told (then nothing was stopped)."""
        _, supervisor = self._worker(name)
        admin = self._admin()
        try:
            entry = admin.drain(name)
            self._rows.put(ray.get(supervisor.draining.remote()))   # status reads DRAINING while it waits
            began, at_start = time.monotonic(), entry["in_flight"]
            end = began + deadline_s
            while entry["in_flight"] > 0 and time.monotonic() < end:
                time.sleep(DRAIN_POLL_S)
                entry = admin.worker(name)
        except BaseException:
            self._rows.put(ray.get(supervisor.draining.remote(False)))   # nothing was stopped: READY again
            raise
        finally:
            admin.close()
        final = ray.get(supervisor.stop.remote(stop_deadline_s))
        self._rows.put(final)
        self._set_targets(stopped=(name,))
        return Drained(final, entry["in_flight"], at_start, time.monotonic() - began)

    def restart(self, name: str, timeout_s: float, stop_deadline_s: float) -> WorkerStatus:
        """Stop `name` (SIGTERM, SIGKILL after `stop_deadline_s`), start it again, wait for READY,
        and let the router pair it again (a drained worker is resumed). The router restarts the same way (a FAILED
        one too); the supervisors tell a new router their workers' states within seconds."""
        _, supervisor = self._worker(name, router=True)
        try:
            status = ray.get(supervisor.restart.remote(timeout_s, stop_deadline_s))
        except RayTaskError as e:
            raise ClusterStartError(f"{name} did not come back: {cause_text(e)}") from None
        self._rows.put(status)
        self._set_targets(started=(name,))
        admin = self._admin()
        try:
            if name == self._spec.router.name:
                self._tell_states(admin)
            else:
                admin.resume(name)
        finally:
            admin.close()
        return status

    def _tell_states(self, admin: RouterAdmin) -> None:
        """A new router knows no worker's state, and the supervisor of a stopped or FAILED worker tells it none:
        each worker's state from its row."""
        for row in self._rows.rows(p.name for p in self._spec.workers):
            if row.state is not None:   # None: a silent supervisor's row; when it speaks again, it tells
                admin.set_state(row.name, row.state, reason_line(row.error))

    def identity(self) -> str | None:
        """Which cluster this controller runs: `cluster_identity` of its admin token (the record has the token)."""
        return cluster_identity(self._spec.admin_token)

    def pids(self) -> list[tuple[str, int]]:
        """(host, pid) of every process of this cluster: controller, supervisors, workers."""
        refs = [a.pids.options(max_task_retries=READ_RETRIES).remote() for a in dict(self._supervisors).values()]
        return [(socket.gethostname(), os.getpid())] + [p for r in refs for p in ray.get(r, timeout=30)]

    def stopping(self) -> bool:  # `up` asks when its checks fail after this `up` returned: did `down` stop it?
        return self._stopping

    def stop(self, deadline_s: float) -> list[str]:
        """Router first, then every worker at once: SIGTERM, SIGKILL after `deadline_s`; returns what failed."""
        self._set_targets(stopped=self._names())  # stopped on purpose, even a process whose stop fails
        self._status_server.stop()
        if self._prober is not None:
            self._prober.stop()
            self._prober = None
        failed: list[str] = []
        with self._supervisors_lock:   # from here `up` (another thread of this actor) creates no supervisor
            self._stopping, supervisors = True, dict(self._supervisors)
        groups = [[a for n, a in supervisors.items() if n == self._spec.router.name],
                  [a for n, a in supervisors.items() if n != self._spec.router.name]]
        for group in groups:
            refs = [a.stop.remote(deadline_s) for a in group]
            for ref in refs:
                try:
                    ray.get(ref)
                except (RayTaskError, RayActorError) as e:
                    failed.append(f"stop failed: {cause_text(e)}")
        for actor in supervisors.values():
            ray.kill(actor)
        self._rows.forget(supervisors)
        self._supervisors.clear()
        return failed


def supervisor_name(worker: str) -> str:
    return f"supervisor-{worker}"
