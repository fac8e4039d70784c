"""The supervisor: a Ray actor that owns one worker process from spawn to exit, on the worker's node.

The process gets its own process group (so `stop` reaches an engine's children) and PR_SET_PDEATHSIG (a dead
supervisor never orphans it); one thread spawns, watches and restarts it, since the death signal follows the
thread that forked. Restart paths: a failed `/health` poll makes a READY worker DEGRADED, a run of them restarts
it; an exit restarts it with backoff as RESTARTING, except exit status 2 at start (a usage error: FAILED at once);
a crash loop (`RestartPolicy`) leaves it FAILED with the reason and the log's tail; a supervisor Ray restarted
reaps the old group and starts the worker again (`actor_record.py`). Every state change is told to the router,
and every change of its status row is pushed to the controller (`status_push.py`: what is read when, and why).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from dsv4_cluster.core import Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.supervise.actor_record import (
    ActorRecord, current_actor_id, read_actor_record, reap_worker, record_path, write_actor_record)
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.launch.port_owner import held_ports_note
from dsv4_cluster.orchestrator.supervise.policy import CrashWindow, HealthPolicy, RestartPolicy
from dsv4_cluster.orchestrator.processes import (
    exit_text, log_tail, signal_group, start_time, stop_groups, with_log_tail)
from dsv4_cluster.orchestrator.readback.probe import first_unready
from dsv4_cluster.orchestrator.supervise.router_admin import RouterAdmin, RouterLink, StateReporter, reason_line
from dsv4_cluster.orchestrator.supervise.spawn import spawn
from dsv4_cluster.orchestrator.supervise.status_push import StatusPusher
from dsv4_cluster.orchestrator.supervise.status_row import Readings, ray_node_id, status_row, take_readings

__all__ = ["HealthPolicy", "RestartPolicy", "WorkerStartError", "WorkerSupervisor", "log_tail"]
logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2
# Exit status 2 before READY is a usage error (argparse's, SGLang's launch_server's, python's own for a missing
# file): the command line itself was refused, and a crash-loop of restarts only delays the error by ~20 s.
USAGE_EXIT_CODE = 2
USAGE_NOTE = " (a usage error: the command line was refused, which a restart cannot mend)"
RETELL_EVERY_POLLS = 15  # the router hears the state again this often, in case it restarted
PINNING_EVERY_POLLS = 15  # pinning is read back at READY and this often (nvidia-smi is slow; it rarely changes)
RESUME_TIMEOUT_S = 300.0  # a resumed worker's start timeout when its record lacks one
HISTORY_LENGTH = 20  # state changes kept for `status` (with the supervisor's own timestamps)


class WorkerStartError(RuntimeError):
    """The worker exited or timed out before it became ready."""


@dataclass(frozen=True)
class _Failure:
    """Why a process is gone or must go; `retry`: whether restarting it can help."""

    reason: str
    retry: bool = True


class WorkerSupervisor:
    """Spawns, watches, restarts and stops one process described by a LaunchPlan."""

    def __init__(self, plan: LaunchPlan, policy: RestartPolicy = RestartPolicy(),
                 health: HealthPolicy = HealthPolicy(), router: RouterLink | None = None,
                 report: Callable[[WorkerStatus], None] | None = None) -> None:
        """`report`: where its status row is pushed on every change (the controller, `ControllerSink`)."""
        self._plan, self._health = plan, health
        self._lock = threading.Lock()
        self._state = WorkerState.STOPPED
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._first_outcome = threading.Event()
        self._start_error: str | None = None
        self._restarts, self._drain, self._log_from = 0, False, 0   # an operator drain; this start's log offset
        self._crashes = CrashWindow(policy)
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(health.timeout_s, connect=min(health.timeout_s, 1.0)))
        self._reporter = StateReporter(RouterAdmin(router)) if router is not None else None
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LENGTH)
        self._record_path = record_path(plan.cwd, f"supervisor-{plan.name}")
        self._running = False   # what its actor record says: the worker should be running
        self._actor_id = current_actor_id()
        self._start_timeout_s: float | None = None
        self._readings: Readings | None = None  # the READY process read back on its last poll
        self._reported_at = 0.0
        self._ray_node_id = ray_node_id()
        self._pusher = StatusPusher(plan.name, self.status, report) if report is not None else None
        self._resume()
        if self._pusher is not None:
            self._pusher.start()  # announces this supervisor: a restarted one's first row goes at once

    # -- surviving its own process ------------------------------------------------------------

    def _write_record(self, running: bool | None = None) -> None:
        """Best effort: without its record a restarted supervisor starts nothing, and says so in its log.
        `running` None: as the record said last (a state change only brings its history up to date)."""
        with self._lock:   # one writer at a time, and never 'running' once a stop began
            self._running = running = (self._running if running is None else running) and not self._stop.is_set()
            pid = self._proc.pid if self._proc is not None else None
            try:
                write_actor_record(self._record_path, ActorRecord(
                    self._actor_id, os.getpid(), pid, start_time(pid) if pid is not None else None,
                    self._restarts, self._start_timeout_s, running, list(self._history), self._crashes.times()))
            except OSError as e:
                logger.error("%s: cannot write the supervisor record %s: %s", self._plan.name, self._record_path, e)

    def _resume(self) -> None:
        """Ray restarted this actor (the worker died with its process): reap the old group, start it; else record."""
        old = read_actor_record(self._record_path)
        if self._actor_id is None or old is None or old.actor_id != self._actor_id or not old.running:
            self._write_record(running=False)
            return
        leftovers = reap_worker(old)
        logger.warning("%s: supervisor restarted by Ray; killed %s left of the old worker; starting it again",
                       self._plan.name, leftovers or "nothing")
        self._restarts, self._running = old.restarts + 1, True
        self._history.extend(old.history)   # `status` and the crash-loop limit go on from before this process died
        self._crashes.restore(old.crashes)
        self._set(WorkerState.STARTING, "its supervisor's process died (the worker with it); Ray restarted the supervisor")
        self._begin(old.start_timeout_s or RESUME_TIMEOUT_S)

    # -- the process thread ---------------------------------------------------------------

    def _set(self, state: WorkerState, error: str | None = None) -> None:
        with self._lock:
            self._state, self._error = state, error
            self._history.append({"at": time.time(), "event": "state", "state": state.value,
                                  "reason": reason_line(error)})
        self._write_record()
        self._changed()
        self._tell_router()

    def _changed(self) -> None:
        """The status row may have changed: the pusher sends it if it did."""
        if self._pusher is not None:
            self._pusher.changed()

    def _read_back(self, pid: int, pinning_due: bool) -> None:
        """Read the READY process back (on its poll), for its status row."""
        last = self._readings
        pinning = last.pinning if last is not None and last.pid == pid and not pinning_due else None
        readings = take_readings(self._plan, self._http, pid, pinning)
        with self._lock:
            self._readings = readings
        self._changed()

    def _tell_router(self, again: bool = False) -> None:
        """Report the current state to the router (`StateReporter`); `again`: even if it has it."""
        if self._reporter is not None:
            self._reporter.report(self._plan.name, self._current, again)

    def _current(self) -> tuple[WorkerState, str | None]:
        with self._lock:
            return self._state, self._error

    def _launch(self, timeout_s: float) -> _Failure | None:
        """Spawn and wait until ready: None when READY, else why not (the process is dead)."""
        plan = self._plan
        try:
            proc, self._log_from = spawn(self._plan)
        except OSError as e:
            return _Failure(f"could not spawn {plan.argv[0]!r}: {e}", retry=False)
        self._proc = proc
        with self._lock:
            self._history.append({"at": time.time(), "event": "spawn", "pid": proc.pid})
        self._changed()
        self._write_record(running=True)   # unless a stop began: `_write_record` checks
        deadline = time.monotonic() + timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                usage = code == USAGE_EXIT_CODE
                return _Failure(with_log_tail(f"{exit_text(code)}{USAGE_NOTE if usage else ''} before it was ready"
                                              f"{held_ports_note(plan.ports)}", plan.log_path, self._log_from),
                                retry=not usage)
            if self._stop.is_set():
                return _Failure("stopped while starting", retry=False)
            pending = first_unready(self._http, plan.all_readiness_urls)
            if pending is None:
                self._read_back(proc.pid, pinning_due=True)
                self._set(WorkerState.READY)
                return None
            if time.monotonic() >= deadline:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                return _Failure(with_log_tail(f"not ready after {timeout_s:.0f}s (still waiting on {pending}); "
                                              f"log {plan.log_path}", plan.log_path, self._log_from), retry=False)
            self._stop.wait(POLL_INTERVAL_S)

    def _restart_delay(self, failure: _Failure) -> float | None:
        """Count a crash: the backoff before restarting, or None (FAILED: a crash loop, or a failure
        a restart cannot mend)."""
        delay = self._crashes.record() if failure.retry else None
        if delay is None:
            self._set(WorkerState.FAILED,
                      self._crashes.giving_up(failure.reason) if failure.retry else failure.reason)
            return None
        with self._lock:
            self._restarts += 1
        self._set(WorkerState.RESTARTING, f"restarting in {delay:.1f}s; last crash: {failure.reason}")
        return delay

    def _relaunch(self, failure: _Failure | None, timeout_s: float) -> _Failure | None:
        """Restart after `failure` as the policy allows: None once READY, else the last failure (FAILED, or stopped)."""
        while failure is not None:
            delay = self._restart_delay(failure)
            if delay is None or self._stop.wait(delay):
                return failure
            failure = self._launch(timeout_s)
        return None

    def _run(self, timeout_s: float) -> None:
        try:
            failure = self._relaunch(self._launch(timeout_s), timeout_s)   # exiting at start is retried like a crash
            if failure is not None:
                self._start_error = self._error if self._state is WorkerState.FAILED else failure.reason
            self._first_outcome.set()
            if failure is None:
                self._keep_running(timeout_s)
        finally:
            if self._proc is not None:
                self._proc.wait()  # this thread must outlive its process (PR_SET_PDEATHSIG)

    def _keep_running(self, timeout_s: float) -> None:
        """Watch the READY process; after it dies or stops answering, restart it as the policy allows."""
        while not self._stop.is_set():
            failure = self._watch()   # None: stopped
            if failure is None or self._relaunch(failure, timeout_s) is not None:
                return

    def _liveness_problem(self) -> str | None:
        """Why the running process does not look alive, or None. A worker is alive while its /health
        answers 200; the router's /health follows its pool (503 without a usable pair), so the
        router is alive while it answers at all."""
        if self._plan.role is not Role.ROUTER:
            return first_unready(self._http, (self._plan.health_url,))
        try:
            self._http.get(self._plan.health_url)
        except httpx.HTTPError as e:
            return f"{self._plan.health_url}: {type(e).__name__}"
        return None

    def _watch(self) -> _Failure | None:
        """Poll the running process until it exits or fails its health checks (why), or stop (None)."""
        proc, plan, failures = self._proc, self._plan, 0
        assert proc is not None
        for polls in itertools.count(1):
            try:
                code = proc.wait(timeout=self._health.interval_s)
            except subprocess.TimeoutExpired:
                code = None
            if self._stop.is_set():
                return None
            if code is not None:
                return _Failure(with_log_tail(f"{exit_text(code)} unexpectedly", plan.log_path, self._log_from))
            problem = self._liveness_problem()
            if problem is None:
                self._read_back(proc.pid, pinning_due=polls % PINNING_EVERY_POLLS == 0)
                if failures:
                    self._set(WorkerState.DRAINING if self._drain else WorkerState.READY)
                failures = 0
            else:
                failures += 1
                if failures >= self._health.failures_to_restart:
                    signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return _Failure(with_log_tail(f"failed {failures} health checks in a row (last: {problem}); "
                                                  "killed", plan.log_path, self._log_from))
                self._set(WorkerState.DEGRADED, f"health check {failures}/{self._health.failures_to_restart} "
                                                f"failed: {problem}")
            self._tell_router(again=polls % RETELL_EVERY_POLLS == 0)
        return None  # unreachable: the loop above only returns

    # -- public API (actor methods) -------------------------------------------------------

    def start(self, timeout_s: float) -> WorkerStatus:
        """Spawn the process and block until it is ready; raises WorkerStartError."""
        with self._lock:
            if self._thread is not None:
                raise WorkerStartError(f"{self._plan.name} was started already ({self._state.value})")
            self._state = WorkerState.STARTING
        self._begin(timeout_s)
        self._first_outcome.wait()
        if self._start_error is not None:
            raise WorkerStartError(f"{self._plan.name} never became ready: {self._start_error}")
        return self.status()

    def _begin(self, timeout_s: float) -> None:
        self._start_timeout_s = timeout_s
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), daemon=True, name=f"proc-{self._plan.name}")
        self._thread.start()

    def draining(self, on: bool = True) -> WorkerStatus:
        """An operator's drain began (the router pairs it no more): a READY row reads DRAINING until `stop`, also
        after a health blip; `on` False: the drain failed before its stop, READY again."""
        self._drain = on
        if self._state is (WorkerState.READY if on else WorkerState.DRAINING):
            self._set(WorkerState.DRAINING if on else WorkerState.READY)
        return self.status()

    def stop(self, deadline_s: float) -> WorkerStatus:
        """SIGTERM the process group, SIGKILL it after `deadline_s`; returns the final status."""
        self._stop.set()
        self._write_record(running=False)  # a supervisor that dies from here on does not start it again
        with self._lock:
            if self._state in (WorkerState.STARTING, WorkerState.READY):
                self._state = WorkerState.DRAINING
        self._changed()
        proc, thread = self._proc, self._thread
        if proc is not None:
            stop_groups([proc.pid], deadline_s)
        if thread is not None:
            thread.join(10.0)
        self._set(WorkerState.STOPPED, None)
        return self.status()

    def restart(self, timeout_s: float, deadline_s: float) -> WorkerStatus:
        """An operator's restart: stop the process (as `stop`), then start it again (as `start`).
        Counted in `restarts`, not as a crash; the crash window starts anew."""
        self.stop(deadline_s)
        with self._lock:
            self._thread, self._start_error = None, None
            self._stop, self._first_outcome = threading.Event(), threading.Event()
            self._restarts += 1
            self._crashes.clear()
            self._drain = False
        return self.start(timeout_s)

    def status(self) -> WorkerStatus:
        """This worker's status row, with the readings of its last poll (no call to the worker)."""
        with self._lock:
            state, error, restarts, history = self._state, self._error, self._restarts, list(self._history)
            proc, readings = self._proc, self._readings
            self._reported_at = max(time.time(), self._reported_at + 1e-6)  # rows are ordered by it
            reported_at = self._reported_at
        pid = proc.pid if proc is not None and proc.returncode is None else None
        return status_row(self._plan, state, error, restarts, history, pid, readings, reported_at, self._ray_node_id)

    def pids(self) -> list[tuple[str, int]]:
        host, proc = socket.gethostname(), self._proc   # this supervisor's, and its process's once spawned
        return [(host, os.getpid())] + ([(host, proc.pid)] if proc is not None else [])
