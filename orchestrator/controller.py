"""The controller: one detached, named Ray actor that owns the cluster's supervisors.

`up` creates it (`name="controller"` in the topology's namespace, `lifetime="detached"`) so it
outlives the CLI; `status` and `down` find it again by name. It creates one supervisor actor per
worker, placed on the worker's node, starts prefill and decode concurrently, and starts the
router only once every worker is READY. The supervisors are owned by the controller: killing the
controller kills them, and their processes die with them (PR_SET_PDEATHSIG). Worker supervisors
tell the router of every state change (admin API, with the cluster's admin token); once the router
is up, a deep probe sends a real request through every prefill -> decode pair periodically.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from dsv4_cluster.orchestrator.errors import ClusterStartError
from dsv4_cluster.core import Role
from dsv4_cluster.orchestrator.deep_probe import DeepProber
from dsv4_cluster.orchestrator.plan import LaunchPlan
from dsv4_cluster.orchestrator.prometheus_targets import record_targets
from dsv4_cluster.orchestrator.router_admin import RouterLink
from dsv4_cluster.orchestrator.supervisor import WorkerSupervisor
from dsv4_cluster.orchestrator.verification import verify_kernels

CONTROLLER_NAME = "controller"
NODE_RESOURCE_SHARE = 0.001  # a sliver of Ray's built-in "node:<ip>" resource pins an actor
SUPERVISOR_CONCURRENCY = 4  # start() blocks while status()/stop() must still answer
DEEP_PROBE_INTERVAL_S = 30.0


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


def _cause(err: BaseException) -> str:
    if isinstance(err, RayTaskError):
        return str(err.cause) if err.cause is not None else str(err)
    return str(err)


class ClusterController:
    """Creates, starts, reports on and stops every supervised process of one cluster."""

    def __init__(self, spec: ClusterSpec) -> None:
        self._spec = spec
        self._supervisors: dict[str, Any] = {}
        self._prober: DeepProber | None = None

    def _missing_nodes(self) -> list[str]:
        """One line per process whose node is not (alive) in the Ray cluster."""
        alive = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        addresses = dict(self._spec.node_addresses)
        return [f"{p.name}: node {p.node!r} ({addresses[p.node]}) is not in the Ray cluster "
                f"(its nodes: {', '.join(sorted(alive))}); on that machine run `ray start "
                f"--address <head> --node-ip-address {addresses[p.node]}`, or fix nodes[].address"
                for p in (*self._spec.workers, self._spec.router) if addresses[p.node] not in alive]

    def _supervisor(self, plan: LaunchPlan) -> Any:
        address = dict(self._spec.node_addresses)[plan.node]
        link = None
        if plan.role is not Role.ROUTER and self._spec.admin_token is not None:
            link = RouterLink.for_router(self._spec.router, self._spec.admin_token)
        actor = ray.remote(WorkerSupervisor).options(
            name=f"supervisor-{plan.name}", num_cpus=0, max_concurrency=SUPERVISOR_CONCURRENCY,
            resources={f"node:{address}": NODE_RESOURCE_SHARE},
        ).remote(plan, router=link)
        self._supervisors[plan.name] = actor
        return actor

    def _start_all(self, plans: list[LaunchPlan], timeout_s: float) -> list[str]:
        refs = {p.name: self._supervisor(p).start.remote(timeout_s) for p in plans}
        failures = []
        for name, ref in refs.items():
            try:
                ray.get(ref)
            except (RayTaskError, RayActorError) as e:
                failures.append(f"{name}: {_cause(e)}")
        return failures

    def up(self, timeout_s: float) -> dict[str, Any]:
        """Start workers, verify them, then start the router; on any failure stop everything
        and raise ClusterStartError listing every problem."""
        failures = self._missing_nodes()
        if not failures:
            failures = self._start_all(list(self._spec.workers), timeout_s)
        if not failures:
            failures = verify_kernels(self._spec.workers, self._spec.kernels)
        if not failures:
            failures = self._start_all([self._spec.router], timeout_s)
        if failures:
            self.stop(deadline_s=10.0)
            raise ClusterStartError("the cluster did not come up:\n" + "\n".join(failures))
        self._prober = DeepProber(self._spec.workers, self._spec.probe_interval_s)
        self._prober.start()
        return self.status()

    def status(self) -> dict[str, Any]:
        """{"endpoint": ..., "workers": [status dict per process, in start order]}."""
        rows = []
        names = [p.name for p in self._spec.workers] + [self._spec.router.name]
        supervisors = dict(self._supervisors)
        refs = {n: supervisors[n].status.remote() for n in names if n in supervisors}
        for name in names:
            if name not in refs:
                continue
            try:
                rows.append(ray.get(refs[name], timeout=30))
            except (RayTaskError, RayActorError) as e:
                rows.append({"name": name, "error": f"supervisor unreachable: {_cause(e)}"})
        probes = self._prober.results() if self._prober is not None else []
        record_targets(self._spec, rows)  # Prometheus file_sd follows the processes
        return {"endpoint": self._spec.endpoint, "workers": rows, "probes": probes}

    def pids(self) -> list[tuple[str, int]]:
        """(host, pid) of every process of this cluster: controller, supervisors, workers."""
        refs = [a.pids.remote() for a in dict(self._supervisors).values()]
        return [(socket.gethostname(), os.getpid())] + [p for r in refs for p in ray.get(r, timeout=30)]

    def stop(self, deadline_s: float) -> dict[str, Any]:
        """Router first, then every worker at once: SIGTERM, SIGKILL after `deadline_s`."""
        if self._prober is not None:
            self._prober.stop()
            self._prober = None
        final: list[dict[str, Any]] = []
        router = self._supervisors.get(self._spec.router.name)
        groups = [[router] if router is not None else [],
                  [a for n, a in self._supervisors.items() if n != self._spec.router.name]]
        for group in groups:
            refs = [a.stop.remote(deadline_s) for a in group]
            for ref in refs:
                try:
                    final.append(ray.get(ref))
                except (RayTaskError, RayActorError) as e:
                    final.append({"error": f"stop failed: {_cause(e)}"})
        for actor in self._supervisors.values():
            ray.kill(actor)
        self._supervisors.clear()
        record_targets(self._spec, final)
        return {"endpoint": self._spec.endpoint, "workers": final}
