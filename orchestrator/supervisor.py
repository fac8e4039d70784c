"""The supervisor: owns one worker process from spawn to exit, on the worker's node.

It runs as a Ray actor (`supervisor_actor()`), one per worker and one for the router. The
process gets its own process group (so `stop` reaches the children an engine spawns, e.g.
SGLang's TP ranks) and PR_SET_PDEATHSIG=SIGKILL (so a dead supervisor never orphans it), and
writes stdout+stderr to its own log file. `start` blocks until every readiness URL answers 200,
failing fast with the log's tail if the process exits first. A dedicated thread spawns the
process and waits on it: the death signal follows the spawning thread, so that thread lives
exactly as long as the process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from dsv4_cluster.core import KvUsage, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import group_members, signal_group
from dsv4_cluster.orchestrator.probe import ProbeError, first_unready, kv_usage

PR_SET_PDEATHSIG = 1
POLL_INTERVAL_S = 0.2
LOG_TAIL_LINES = 30


class WorkerStartError(RuntimeError):
    """The worker exited or timed out before it became ready."""


def _death_signal_preexec(parent_pid: int) -> Any:
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the supervisor died between fork and prctl
            os._exit(1)

    return preexec


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return "(no log file)"


class WorkerSupervisor:
    """Spawns, watches and stops one process described by a LaunchPlan."""

    def __init__(self, plan: LaunchPlan) -> None:
        self._plan = plan
        self._lock = threading.Lock()
        self._state = WorkerState.STOPPED
        self._proc: subprocess.Popen[bytes] | None = None
        self._spawned = threading.Event()
        self._exited = threading.Event()
        self._spawn_error: BaseException | None = None
        self._stopping = False
        self._restarts = 0
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0))

    # -- process thread -------------------------------------------------------------------

    def _run_process(self) -> None:
        plan = self._plan
        try:
            Path(plan.log_path).parent.mkdir(parents=True, exist_ok=True)
            Path(plan.cwd).mkdir(parents=True, exist_ok=True)
            with open(plan.log_path, "ab") as log:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
                log.write(f"=== {stamp} supervisor starts: {' '.join(plan.argv)}\n".encode())
                log.flush()
                proc = subprocess.Popen(
                    list(plan.argv), cwd=plan.cwd, env={**os.environ, **plan.env_dict},
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_death_signal_preexec(os.getpid()),
                )
        except OSError as e:
            self._spawn_error = e
            self._spawned.set()
            self._exited.set()
            return
        self._proc = proc
        self._spawned.set()
        code = proc.wait()
        with self._lock:
            if not self._stopping:
                self._state = WorkerState.FAILED
                self._error = (f"exited unexpectedly with code {code}; last log lines:\n"
                               f"{log_tail(plan.log_path)}")
        self._exited.set()

    # -- public API (actor methods) -------------------------------------------------------

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Spawn the process and block until it is ready; raises WorkerStartError."""
        with self._lock:
            if self._state in (WorkerState.STARTING, WorkerState.READY):
                raise WorkerStartError(f"{self._plan.name} is already {self._state.value}")
            self._state, self._error, self._stopping = WorkerState.STARTING, None, False
            self._spawned.clear()
            self._exited.clear()
            self._spawn_error = None
        self._thread = threading.Thread(target=self._run_process, name=f"proc-{self._plan.name}",
                                        daemon=True)
        self._thread.start()
        self._spawned.wait()
        if self._spawn_error is not None:
            self._fail(f"could not spawn {self._plan.argv[0]!r}: {self._spawn_error}")
        self._wait_ready(timeout_s)
        return self.status()

    def _fail(self, message: str) -> None:
        with self._lock:
            self._state, self._error = WorkerState.FAILED, message
        raise WorkerStartError(f"{self._plan.name}: {message}")

    def _wait_ready(self, timeout_s: float) -> None:
        plan = self._plan
        deadline = time.monotonic() + timeout_s
        pending: str | None = "not probed yet"
        while True:
            if self._exited.is_set():
                with self._lock:
                    error = self._error or "stopped while starting"
                raise WorkerStartError(f"{plan.name} never became ready: {error}")
            pending = first_unready(self._http, plan.all_readiness_urls)
            if pending is None:
                with self._lock:
                    if self._state is WorkerState.STARTING:
                        self._state = WorkerState.READY
                return
            if time.monotonic() >= deadline:
                self._kill_group(signal.SIGKILL)
                self._exited.wait(10.0)
                self._fail(f"not ready after {timeout_s:.0f}s (still waiting on {pending}); "
                           f"log {plan.log_path}, last lines:\n{log_tail(plan.log_path)}")
            self._exited.wait(POLL_INTERVAL_S)

    def _kill_group(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is not None:
            signal_group(proc.pid, sig)

    def stop(self, deadline_s: float) -> dict[str, Any]:
        """SIGTERM the process group, SIGKILL it after `deadline_s`; returns the final status."""
        with self._lock:
            self._stopping = True
            if self._state in (WorkerState.STARTING, WorkerState.READY):
                self._state = WorkerState.DRAINING
        proc = self._proc
        if proc is not None:
            self._kill_group(signal.SIGTERM)
            if not self._exited.wait(deadline_s):
                self._kill_group(signal.SIGKILL)
                self._exited.wait(10.0)
            end = time.monotonic() + deadline_s
            while group_members(proc.pid) and time.monotonic() < end:
                self._exited.wait(POLL_INTERVAL_S)
            if group_members(proc.pid):
                self._kill_group(signal.SIGKILL)
        with self._lock:
            if self._state is not WorkerState.FAILED:
                self._state = WorkerState.STOPPED
        return self.status()

    def status(self) -> dict[str, Any]:
        """This worker's status row as a dict (see WorkerStatus)."""
        plan = self._plan
        with self._lock:
            state, error, restarts = self._state, self._error, self._restarts
        proc = self._proc
        pid = proc.pid if proc is not None and state not in (WorkerState.STOPPED,) else None
        kv: KvUsage | None = None
        if state is WorkerState.READY and plan.server_info_url is not None:
            try:
                kv = kv_usage(self._http, plan.server_info_url, plan.metrics_url)
            except (httpx.HTTPError, ProbeError, ValueError) as e:
                error = f"KV probe failed: {e}"
        return WorkerStatus(
            name=plan.name, role=plan.role, node=plan.node, state=state, pid=pid,
            port=plan.port, restarts=restarts, kv=kv, log_path=plan.log_path, error=error,
        ).to_dict()

    def pids(self) -> dict[str, int | None]:
        """This supervisor's pid and its process's (None before spawn)."""
        proc = self._proc
        return {"supervisor": os.getpid(), "process": proc.pid if proc is not None else None}
