"""The supervisor: owns one worker process from spawn to exit, on the worker's node.

It runs as a Ray actor (`supervisor_actor()`), one per worker and one for the router. The
process gets its own process group (so `stop` reaches the children an engine spawns, e.g.
SGLang's TP ranks) and PR_SET_PDEATHSIG=SIGKILL (so a dead supervisor never orphans it), and
writes stdout+stderr to its own log file. `start` blocks until every readiness URL answers 200,
failing fast with the log's tail if the process exits first. A process that crashes after it
was READY is restarted with exponential backoff; after `RestartPolicy.max_restarts` crashes
within `window_s` the supervisor gives up, says why, and the state stays FAILED.

One dedicated thread spawns the process, waits for readiness, waits on it and restarts it: the
death signal follows the thread that forked, so that thread outlives every process it spawns.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dsv4_cluster.core import KvUsage, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import group_members, signal_group
from dsv4_cluster.orchestrator.kernel_verify import attested_kernels
from dsv4_cluster.orchestrator.probe import ProbeError, engine_info, first_unready

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


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a crashed worker after backoff_s, doubling per recent crash up to backoff_max_s;
    give up once more than max_restarts crashes fall within window_s."""

    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def delay(self, recent_crashes: int) -> float | None:
        if recent_crashes > self.max_restarts:
            return None
        return min(self.backoff_s * 2 ** (recent_crashes - 1), self.backoff_max_s)


class WorkerSupervisor:
    """Spawns, watches, restarts and stops one process described by a LaunchPlan."""

    def __init__(self, plan: LaunchPlan, policy: RestartPolicy = RestartPolicy()) -> None:
        self._plan, self._policy = plan, policy
        self._lock = threading.Lock()
        self._state = WorkerState.STOPPED
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._first_outcome = threading.Event()
        self._start_error: str | None = None
        self._restarts = 0
        self._crashes: deque[float] = deque()
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0))

    # -- the process thread ---------------------------------------------------------------

    def _set(self, state: WorkerState, error: str | None = None) -> None:
        with self._lock:
            self._state, self._error = state, error

    def _spawn(self) -> subprocess.Popen[bytes]:
        plan = self._plan
        Path(plan.log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(plan.cwd).mkdir(parents=True, exist_ok=True)
        for path, text in plan.files:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        with open(plan.log_path, "ab") as log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log.write(f"=== {stamp} supervisor starts: {' '.join(plan.argv)}\n".encode())
            log.flush()
            return subprocess.Popen(
                list(plan.argv), cwd=plan.cwd, env={**os.environ, **plan.env_dict},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_death_signal_preexec(os.getpid()),
            )

    def _launch(self, timeout_s: float) -> str | None:
        """Spawn and wait until ready: None when READY, else why not (the process is dead)."""
        plan = self._plan
        try:
            proc = self._spawn()
        except OSError as e:
            return f"could not spawn {plan.argv[0]!r}: {e}"
        self._proc = proc
        deadline = time.monotonic() + timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                return (f"exited with code {code} before it was ready; last log lines:\n"
                        f"{log_tail(plan.log_path)}")
            if self._stop.is_set():
                return "stopped while starting"
            pending = first_unready(self._http, plan.all_readiness_urls)
            if pending is None:
                self._set(WorkerState.READY)
                return None
            if time.monotonic() >= deadline:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                return (f"not ready after {timeout_s:.0f}s (still waiting on {pending}); "
                        f"log {plan.log_path}, last lines:\n{log_tail(plan.log_path)}")
            self._stop.wait(POLL_INTERVAL_S)

    def _next_restart_delay(self, reason: str) -> float | None:
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self._policy.window_s:
            self._crashes.popleft()
        delay = self._policy.delay(len(self._crashes))
        if delay is None:
            self._set(WorkerState.FAILED,
                      f"gave up after {len(self._crashes)} crashes within "
                      f"{self._policy.window_s:.0f}s (crash loop); last: {reason}")
        else:
            with self._lock:
                self._state = WorkerState.STARTING
                self._error = f"restarting in {delay:.1f}s; last crash: {reason}"
                self._restarts += 1
        return delay

    def _run(self, timeout_s: float) -> None:
        try:
            self._start_error = self._launch(timeout_s)
            if self._start_error is not None:
                self._set(WorkerState.FAILED, self._start_error)
            self._first_outcome.set()
            if self._start_error is None:
                self._keep_running(timeout_s)
        finally:
            if self._proc is not None:
                self._proc.wait()  # this thread must outlive its process (PR_SET_PDEATHSIG)

    def _keep_running(self, timeout_s: float) -> None:
        """Wait on the READY process; after a crash restart it as the policy allows."""
        error: str | None = None
        while not self._stop.is_set():
            if error is None and self._proc is not None:
                code = self._proc.wait()
                if self._stop.is_set():
                    return
                error = (f"exited unexpectedly with code {code}; last log lines:\n"
                         f"{log_tail(self._plan.log_path)}")
            delay = self._next_restart_delay(error or "no process")
            if delay is None or self._stop.wait(delay):
                return
            error = self._launch(timeout_s)

    # -- public API (actor methods) -------------------------------------------------------

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Spawn the process and block until it is ready; raises WorkerStartError."""
        with self._lock:
            if self._thread is not None:
                raise WorkerStartError(f"{self._plan.name} was started already ({self._state.value})")
            self._state = WorkerState.STARTING
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), daemon=True,
                                        name=f"proc-{self._plan.name}")
        self._thread.start()
        self._first_outcome.wait()
        if self._start_error is not None:
            raise WorkerStartError(f"{self._plan.name} never became ready: {self._start_error}")
        return self.status()

    def stop(self, deadline_s: float) -> dict[str, Any]:
        """SIGTERM the process group, SIGKILL it after `deadline_s`; returns the final status."""
        self._stop.set()
        with self._lock:
            if self._state in (WorkerState.STARTING, WorkerState.READY):
                self._state = WorkerState.DRAINING
        proc, thread = self._proc, self._thread
        if proc is not None:
            signal_group(proc.pid, signal.SIGTERM)
            end = time.monotonic() + deadline_s
            while group_members(proc.pid) and time.monotonic() < end:
                time.sleep(POLL_INTERVAL_S / 2)
            if group_members(proc.pid):
                signal_group(proc.pid, signal.SIGKILL)
        if thread is not None:
            thread.join(10.0)
        with self._lock:
            self._state = WorkerState.STOPPED
        return self.status()

    def status(self) -> dict[str, Any]:
        """This worker's status row as a dict (see WorkerStatus)."""
        plan = self._plan
        with self._lock:
            state, error, restarts = self._state, self._error, self._restarts
        proc = self._proc
        pid = proc.pid if proc is not None and proc.returncode is None else None
        kv: KvUsage | None = None
        kernels: tuple[tuple[str, str], ...] = ()
        if state is WorkerState.READY and plan.server_info_url is not None:
            try:
                info = engine_info(self._http, plan.server_info_url, plan.metrics_url)
                kv, kernels = info.kv, info.kernels
            except (httpx.HTTPError, ProbeError, ValueError) as e:
                error = f"/server_info probe failed: {e}"
            kernels = kernels or attested_kernels(plan, pid)  # SGLang: its ranks attest, not /server_info
        return WorkerStatus(
            name=plan.name, role=plan.role, node=plan.node, state=state, pid=pid,
            port=plan.port, restarts=restarts, kv=kv, log_path=plan.log_path, error=error,
            kernels=kernels,
        ).to_dict()

    def pids(self) -> list[tuple[str, int]]:
        """(host, pid) of this supervisor and of its process once spawned."""
        host, proc = socket.gethostname(), self._proc
        return [(host, os.getpid())] + ([(host, proc.pid)] if proc is not None else [])
