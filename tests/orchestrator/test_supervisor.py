"""WorkerSupervisor against a real child process: a tiny stand-in HTTP server (a fake allowed in
this one component's unit test) that can be slow to become ready, crash, ignore SIGTERM, or fork a
grandchild. The supervisor runs in-process here; test_orchestrator drives it as a Ray actor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv4_cluster.core import Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.launch.ports import free_ports, port_is_free
from dsv4_cluster.orchestrator.processes import log_tail, pid_alive
from dsv4_cluster.orchestrator.supervise.supervisor import (
    HealthPolicy, RestartPolicy, WorkerStartError, WorkerSupervisor)
from tests.helpers import SOON_S, gone, latest_when, wait_for

STANDIN = textwrap.dedent('''
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int); p.add_argument("--ready-after", type=float, default=0)
    p.add_argument("--exit-after", type=float, default=None); p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--grandchild-pidfile", default=None); p.add_argument("--no-used-in-info", action="store_true")
    p.add_argument("--unhealthy-after", type=float, default=None); p.add_argument("--unhealthy-for", type=float, default=1e9)
    a = p.parse_args()
    t0 = time.monotonic()
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.grandchild_pidfile:
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(a.grandchild_pidfile, "w").write(str(g.pid))
    class H(BaseHTTPRequestHandler):
        def log_message(self, *args): pass
        def _send(self, code, body, ctype="application/json"):
            data = body.encode(); self.send_response(code); self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
        def do_GET(self):
            age = time.monotonic() - t0
            ready = age >= a.ready_after
            if a.unhealthy_after is not None and a.unhealthy_after <= age < a.unhealthy_after + a.unhealthy_for:
                ready = False
            if self.path == "/health":
                return self._send(200 if ready else 503, "{}")
            if self.path == "/server_info":
                state = {} if a.no_used_in_info else {"num_used_tokens": 7}
                return self._send(200, json.dumps({"max_total_num_tokens": 1000, "internal_states": [state]}))
            if self.path == "/metrics":
                return self._send(200, 'sglang:num_used_tokens{model_name="m",engine_type="decode"} 42.0\\n', "text/plain")
            self._send(404, "{}")
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), H)
    print("stand-in listening", a.port, flush=True)
    if a.exit_after is not None:
        import threading
        threading.Timer(a.exit_after, lambda: (print("stand-in crashing now", flush=True), os._exit(3))).start()
    srv.serve_forever()
''')


def _plan(tmp_path: Path, *flags: str, port: int | None = None) -> LaunchPlan:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    port = port or free_ports(1)[0]
    base = f"http://127.0.0.1:{port}"
    return LaunchPlan(
        name="decode-t", role=Role.DECODE, node="local",
        argv=(sys.executable, str(script), "--port", str(port), *flags), env=(("STANDIN", "1"),),
        cwd=str(tmp_path), log_path=str(tmp_path / "logs" / "decode-t.log"), port=port,
        health_url=f"{base}/health", server_info_url=f"{base}/server_info",
        metrics_url=f"{base}/metrics", ports=(port,),
    )


def _wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    return gone([pid], timeout_s) == []


def test_start_reports_ready_with_kv_then_stop_frees_everything(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "--ready-after", "0.5")
    sup = WorkerSupervisor(plan)
    status = sup.start(timeout_s=30)
    assert status.state == WorkerState.READY.value
    assert status.restarts == 0 and status.port == plan.port
    assert (status.kv.capacity_tokens, status.kv.used_tokens) == (1000, 7)
    pid = status.pid
    assert pid_alive(pid)
    assert "stand-in listening" in Path(plan.log_path).read_text()
    final = sup.stop(deadline_s=5)
    assert final.state == WorkerState.STOPPED.value and final.pid is None
    assert _wait_dead(pid)
    assert port_is_free(plan.port)


def test_kv_usage_falls_back_to_metrics(tmp_path: Path) -> None:
    sup = WorkerSupervisor(_plan(tmp_path, "--no-used-in-info"))
    try:
        status = sup.start(timeout_s=30)
        assert (status.kv.capacity_tokens, status.kv.used_tokens) == (1000, 42)
    finally:
        sup.stop(deadline_s=5)


def test_exit_during_start_fails_fast_with_log_tail(tmp_path: Path) -> None:
    """Each exit before READY is seen at once, not at the start timeout: restarted as a crash, then FAILED. Short
    backoffs here (the default policy sleeps 7 s); backoff is `test_crash_after_ready_is_restarted_with_backoff`'s."""
    sup = WorkerSupervisor(_plan(tmp_path, "--ready-after", "60", "--exit-after", "0.5"), RestartPolicy(backoff_s=0.1))
    started = time.monotonic()
    with pytest.raises(WorkerStartError) as err:
        sup.start(timeout_s=60)
    assert time.monotonic() - started < 15
    assert "code 3" in str(err.value) and "stand-in crashing now" in str(err.value)
    assert sup.status().state == WorkerState.FAILED.value


def test_a_usage_error_at_start_fails_at_once_without_restarts(tmp_path: Path) -> None:
    """Exit status 2 before READY (argparse refusing a flag): no crash loop, the refusal in the error."""
    sup = WorkerSupervisor(_plan(tmp_path, "--no-such-flag"), RestartPolicy(max_restarts=5, backoff_s=1.0))
    with pytest.raises(WorkerStartError) as err:
        sup.start(timeout_s=60)
    assert "code 2 (a usage error" in str(err.value) and "--no-such-flag" in str(err.value)
    status = sup.status()
    assert (status.state, status.restarts) == (WorkerState.FAILED.value, 0)
    assert Path(status.log_path).read_text().count("supervisor starts") == 1


def test_spawn_failure_names_the_command(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    bad = LaunchPlan(**{**plan.__dict__, "argv": ("/nonexistent/engine", "--port", "1")})
    with pytest.raises(WorkerStartError, match="/nonexistent/engine"):
        WorkerSupervisor(bad).start(timeout_s=5)


def test_timeout_names_the_pending_url_and_kills_the_process(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "--ready-after", "600")
    sup = WorkerSupervisor(plan)
    with pytest.raises(WorkerStartError, match=r"not ready after 2s .*?/health: HTTP 503"):
        sup.start(timeout_s=2)
    pid = sup.pids()[-1][1]
    assert pid is not None and _wait_dead(pid)
    assert sup.status().state == WorkerState.FAILED.value


def _wait_for(sup: WorkerSupervisor, pred, timeout_s: float = 20.0) -> WorkerStatus:
    """The supervisor's status once `pred` holds, else its last one (`latest_when`)."""
    return latest_when(sup.status, pred, timeout_s, interval_s=0.1)


def test_crash_after_ready_is_restarted_with_backoff(tmp_path: Path) -> None:
    sup = WorkerSupervisor(_plan(tmp_path, "--exit-after", "1.0"),
                           RestartPolicy(max_restarts=5, backoff_s=0.2))
    first = sup.start(timeout_s=30).pid
    try:
        status = _wait_for(sup, lambda s: s.restarts == 1 and s.state == "READY")
        assert (status.restarts, status.state) == (1, "READY")
        assert status.pid != first and _wait_dead(first)
        assert Path(sup.status().log_path).read_text().count("supervisor starts") >= 2
    finally:
        sup.stop(deadline_s=5)


def _crash_loop(tmp_path: Path) -> WorkerSupervisor:
    """A worker that exits 0.3 s after it is ready, under a policy of two restarts in 60 s: FAILED soon."""
    sup = WorkerSupervisor(_plan(tmp_path, "--exit-after", "0.3"),
                           RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.1))
    sup.start(timeout_s=30)
    return sup


def test_a_crash_loop_gives_up_and_says_why(tmp_path: Path) -> None:
    sup = _crash_loop(tmp_path)
    status = _wait_for(sup, lambda s: s.state == WorkerState.FAILED.value)
    assert status.state == WorkerState.FAILED.value and status.pid is None
    assert status.restarts == 2
    assert "gave up after 3 crashes within 60s" in status.error
    assert "code 3" in status.error and "last log lines:\n" in status.error and "stand-in crashing now" in status.error
    reasons = [h["reason"] for h in status.history if h.get("reason")]   # first lines: none ends "last log lines:"
    assert reasons[-1] == "gave up after 3 crashes within 60s (crash loop); last: exited with code 3 unexpectedly"
    assert not [r for r in reasons if r.endswith(":")], reasons
    assert sup.stop(deadline_s=2).state == WorkerState.STOPPED.value


def test_a_worker_killed_by_a_signal_is_reported_by_the_signals_name(tmp_path: Path) -> None:
    """`kill -9` of a READY worker read "exited unexpectedly with code -9"; and a limit of no restarts said
    "gave up after 1 crashes"."""
    sup = WorkerSupervisor(_plan(tmp_path), RestartPolicy(max_restarts=0, window_s=60))
    pid = sup.start(timeout_s=30).pid
    try:
        os.kill(pid, signal.SIGKILL)
        status = _wait_for(sup, lambda s: s.state == WorkerState.FAILED.value)
        assert status.state == WorkerState.FAILED.value, status
        assert "gave up after 1 crash within 60s" in status.error
        assert "was killed by SIGKILL unexpectedly" in status.error
    finally:
        sup.stop(deadline_s=2)


def test_an_operator_restart_of_a_failed_worker_starts_a_new_crash_window(tmp_path: Path) -> None:
    """After a crash loop, `restart` gets the worker its backoff restarts again: its next crash is not the last."""
    sup = _crash_loop(tmp_path)
    assert _wait_for(sup, lambda s: s.state == WorkerState.FAILED.value).state == WorkerState.FAILED.value
    sup.restart(timeout_s=30, deadline_s=2)
    status = _wait_for(sup, lambda s: s.state == WorkerState.FAILED.value)
    try:
        assert status.state == WorkerState.FAILED.value
        assert "gave up after 3 crashes within 60s" in status.error   # not 4: the crashes before the restart
        assert status.restarts == 2 + 1 + 2
    finally:
        sup.stop(deadline_s=2)


def test_an_exit_at_start_names_the_process_holding_its_port(tmp_path: Path) -> None:
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        sup = WorkerSupervisor(_plan(tmp_path, port=port), RestartPolicy(max_restarts=0))
        with pytest.raises(WorkerStartError) as err:
            sup.start(timeout_s=30)
    finally:
        holder.close()
    assert f"port {port} is in use by pid {os.getpid()} (" in str(err.value)


def test_a_start_that_fails_shows_its_own_log_lines_not_an_earlier_starts(tmp_path: Path) -> None:
    """Logs are appended to across starts (and `up`s): a start that failed after writing few lines showed the last
    lines of the one before it as its own."""
    plan = _plan(tmp_path)
    marker = tmp_path / "second"
    script = tmp_path / "twice.py"   # a file: the log's header line names the argv
    script.write_text("import pathlib, sys; m = pathlib.Path(sys.argv[1])\n"
                      "if m.exists(): print('second start: bad flag'); sys.exit(2)\n"
                      "m.touch(); [print(f'first start line {i}') for i in range(40)]; sys.exit(1)\n")
    failing = LaunchPlan(**{**plan.__dict__, "argv": (sys.executable, str(script), str(marker))})
    errors = []
    for _ in range(2):
        with pytest.raises(WorkerStartError) as err:
            WorkerSupervisor(failing, RestartPolicy(max_restarts=0)).start(timeout_s=30)
        errors.append(str(err.value))
    assert "first start line 39" in errors[0] and "second start" not in errors[0]
    assert "second start: bad flag" in errors[1] and "first start line" not in errors[1], errors[1]
    assert Path(plan.log_path).read_text().count("first start line") == 40


def test_a_log_truncated_under_its_writer_shows_its_lines_from_the_start(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("old\n" * 100)
    offset = log.stat().st_size
    log.write_text("after copytruncate\n")
    assert log_tail(str(log), offset=offset) == "after copytruncate\n"
    assert log_tail(str(log), offset=6) == "after copytruncate\n"   # written past the offset again: mid-line there
    log.write_text("old\nnew\n")
    assert log_tail(str(log), offset=4) == "new\n"                  # a line starts at the offset: from there


def test_an_exit_with_an_empty_log_says_so_instead_of_an_empty_tail(tmp_path: Path) -> None:
    """A log emptied under the worker (copytruncate) left the reason ending "last log lines:" and nothing."""
    plan = _plan(tmp_path)
    truncating = (sys.executable, "-c", "import sys; open(sys.argv[1], 'w').close(); sys.exit(1)", plan.log_path)
    sup = WorkerSupervisor(LaunchPlan(**{**plan.__dict__, "argv": truncating}), RestartPolicy(max_restarts=0))
    with pytest.raises(WorkerStartError) as err:
        sup.start(timeout_s=30)
    assert str(err.value).endswith("exited with code 1 before it was ready (the log is empty)"), str(err.value)


def test_stop_escalates_to_sigkill_and_reaches_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    sup = WorkerSupervisor(_plan(tmp_path, "--ignore-sigterm", "--grandchild-pidfile", str(pidfile)))
    pid = sup.start(timeout_s=30).pid
    grandchild = int(pidfile.read_text())
    started = time.monotonic()
    final = sup.stop(deadline_s=1.0)
    assert final.state == WorkerState.STOPPED.value
    assert 0.9 < time.monotonic() - started < 10
    assert _wait_dead(pid) and _wait_dead(grandchild)


def test_a_killed_supervisor_takes_its_process_with_it(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    driver = textwrap.dedent(f"""
        import pickle, sys, threading
        from dsv4_cluster.orchestrator.supervise.supervisor import WorkerSupervisor
        sup = WorkerSupervisor(pickle.loads({pickle_bytes(plan)!r}))
        print(sup.start(timeout_s=30).pid, flush=True)
        threading.Event().wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert pid_alive(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _wait_dead(pid), "the worker outlived its supervisor (PR_SET_PDEATHSIG missing?)"
    finally:
        proc.kill()
        proc.wait()


def pickle_bytes(obj: object) -> bytes:
    import pickle

    return pickle.dumps(obj)


FAST_HEALTH = HealthPolicy(interval_s=0.2, timeout_s=1.0, failures_to_restart=3)


def test_a_worker_that_stops_answering_health_is_degraded_then_restarted(tmp_path: Path) -> None:
    """... and the controller's side hears every change, in order, as its supervisor pushes it."""
    pushed: list[WorkerStatus] = []
    sup = WorkerSupervisor(_plan(tmp_path, "--unhealthy-after", "1.0"), RestartPolicy(backoff_s=0.1),
                           FAST_HEALTH, report=pushed.append)
    announced = wait_for(lambda: pushed[:1], SOON_S, "the supervisor's first row, pushed before any change")
    assert (announced[0].state, announced[0].pid) == ("STOPPED", None)
    first = sup.start(timeout_s=30).pid
    try:
        degraded = _wait_for(sup, lambda s: s.state == "DEGRADED")
        assert degraded.state == "DEGRADED" and "health check 1/3 failed" in degraded.error
        assert "stand-in listening" in degraded.log_tail
        status = _wait_for(sup, lambda s: s.restarts == 1 and s.state == "READY")
        assert (status.restarts, status.state, status.log_tail) == (1, "READY", None)
        assert status.pid != first and _wait_dead(first)
        wait_for(lambda: any(r.restarts == 1 and r.state == "READY" for r in pushed), SOON_S, "READY again pushed")
    finally:
        sup.stop(deadline_s=5)
    states = [(r.state.value, r.restarts) for r in pushed]
    changes = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
    # a push sends the row of that moment (a state shorter than one push may be skipped); these last polls
    assert changes.index(("DEGRADED", 0)) < changes.index(("READY", 1)), changes
    assert [r.reported_at for r in pushed] == sorted({r.reported_at for r in pushed})  # read order, no repeats
    ready = next(r for r in pushed if r.state == "READY")
    assert (ready.pid, ready.kv.capacity_tokens, ready.kv.used_tokens) == (first, 1000, 7)  # read on the poll


def test_a_short_health_blip_is_degraded_and_back_without_a_restart(tmp_path: Path) -> None:
    sup = WorkerSupervisor(_plan(tmp_path, "--unhealthy-after", "1.0", "--unhealthy-for", "0.3"),
                           RestartPolicy(backoff_s=0.1), FAST_HEALTH)
    pid = sup.start(timeout_s=30).pid
    try:
        assert _wait_for(sup, lambda s: s.state == "DEGRADED").state == "DEGRADED"
        status = _wait_for(sup, lambda s: s.state == "READY")
        assert (status.state, status.restarts, status.pid) == ("READY", 0, pid)
    finally:
        sup.stop(deadline_s=5)


def test_a_drain_reads_draining_through_a_health_blip_and_ready_again_when_it_fails(tmp_path: Path) -> None:
    """`draining`: READY reads DRAINING (the controller's drain waits for in-flight requests); a health blip in the
    meantime comes back to DRAINING, not READY; `draining(False)` (the drain failed, nothing was stopped) is READY."""
    sup = WorkerSupervisor(_plan(tmp_path, "--unhealthy-after", "1.0", "--unhealthy-for", "0.3"),
                           RestartPolicy(backoff_s=0.1), FAST_HEALTH)
    sup.start(timeout_s=30)
    try:
        assert sup.draining().state == "DRAINING"
        assert _wait_for(sup, lambda s: s.state == "DEGRADED").state == "DEGRADED"
        assert _wait_for(sup, lambda s: s.state != "DEGRADED").state == "DRAINING"
        assert sup.draining(False).state == "READY"
    finally:
        sup.stop(deadline_s=5)


def test_the_router_hears_every_state_change(tmp_path: Path) -> None:
    """The real router app (admin API) learns DEGRADED, RESTARTING, READY and STOPPED of a worker."""
    from dsv4_cluster.orchestrator.supervise.router_admin import RouterAdmin, RouterLink
    from dsv4_cluster.router.app import build_app
    from dsv4_cluster.router.settings import RouterSettings

    from tests.servers import UvicornThread

    plan = _plan(tmp_path, "--unhealthy-after", "1.5")
    token = "t" * 32
    worker_url = plan.health_url.removesuffix("/health")
    settings = RouterSettings(model_name="m", admin_token=token, health_check_interval_s=60,
                              prefill=[{"name": "prefill-x", "url": worker_url, "bootstrap_host": "127.0.0.1"}],
                              decode=[{"name": plan.name, "url": worker_url}])
    with UvicornThread(build_app(settings)) as router:
        link = RouterLink(router.url, token)
        admin = RouterAdmin(link)
        seen: list[str] = []
        sup = WorkerSupervisor(plan, RestartPolicy(backoff_s=0.5), FAST_HEALTH, router=link)
        sup.start(timeout_s=30)
        try:
            def back() -> bool:   # every state the router is told, in order, until READY after RESTARTING
                state = admin.worker(plan.name)["state"]
                if not seen or seen[-1] != state:
                    seen.append(state)
                return seen[-1] == "READY" and "RESTARTING" in seen
            wait_for(back, 30, f"the router to be told READY after RESTARTING (told: {seen})")
            assert seen[:1] == ["READY"] and "DEGRADED" in seen and "RESTARTING" in seen, seen
            assert seen[-1] == "READY", seen
            assert admin.worker(plan.name)["reason"] is None
        finally:
            sup.stop(deadline_s=5)
        entry = admin.worker(plan.name)
        assert entry["state"] == "STOPPED" and not entry["eligible"]
        admin.close()
