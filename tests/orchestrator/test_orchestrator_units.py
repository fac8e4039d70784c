"""Small orchestrator pieces without a cluster: the status table, the cluster record, ports,
process liveness, kernel verification."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4_cluster.core import ClusterStatus, KvUsage, ProbeResult, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.launch.ports import free_ports, port_is_free
from dsv4_cluster.orchestrator.processes import group_members, pid_alive
from dsv4_cluster.orchestrator.cluster.options import DownOptions
from dsv4_cluster.orchestrator.errors import NotUpError
from dsv4_cluster.orchestrator.cluster.record import (
    HOME_ENV, ClusterRecord, HeadProcess, RecordError, clear_record, read_record, write_record)
from dsv4_cluster.orchestrator.cli.table import COLUMNS, render_table
from dsv4_cluster.orchestrator.verify.embedded_calls import Calls, call_problems
from dsv4_cluster.orchestrator.verify.sequence import kernel_problems
from tests.helpers import wait_for


def _row(**kw: object) -> WorkerStatus:
    base = dict(name="decode-0", role=Role.DECODE, node="local", state=WorkerState.READY, pid=42,
                port=30200, restarts=0, kv=KvUsage(16384, 128), log_path="/x/decode-0.log")
    return WorkerStatus(**{**base, **kw})


def test_worker_status_round_trips_through_its_dict() -> None:
    rows = (_row(), _row(kv=None, pid=None, state=WorkerState.FAILED, error="boom"),
            _row(kernels=(("indexer", "triton"), ("topk", "off"))), _row(state=None, kv_predicted_tokens=9),
            _row(reported_at=1733360000.25, ray_node_id="n1"))
    for row in rows:
        assert WorkerStatus.from_dict(json.loads(json.dumps(row.to_dict()))) == row
    d = _row().to_dict()
    assert (d["kv_capacity_tokens"], d["kv_used_tokens"], d["state"], d["role"]) == \
        (16384, 128, "READY", "decode")


def test_table_has_every_column_and_dashes_for_the_router() -> None:
    router = _row(name="router", role=Role.ROUTER, kv=None, port=30001, pid=7)
    failed = _row(name="prefill-0", role=Role.PREFILL, state=WorkerState.FAILED, pid=None,
                  kv=None, error="exited with code 3")
    text = render_table(ClusterStatus("e", (_row(), router, failed)))
    lines = text.splitlines()
    assert lines[0].split() == list(COLUMNS)
    assert lines[1].split() == ["decode-0", "decode", "local", "42", "READY", "0", "30200",
                                "16384", "128", "-"]
    assert lines[2].split() == ["router", "router", "local", "7", "READY", "0", "30001", "-", "-", "-"]
    assert lines[3].split()[3:5] == ["-", "FAILED"]
    assert lines[4] == "prefill-0: exited with code 3"


def test_draining_a_roles_last_ready_worker_warns_first(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`drain decode-0` on the only decode took serving down without a word."""
    from dsv4_cluster.orchestrator.cli import ops

    rows = (_row(), _row(name="decode-1", state=WorkerState.RESTARTING), _row(name="prefill-0", role=Role.PREFILL),
            _row(name="prefill-1", role=Role.PREFILL), _row(name="router", role=Role.ROUTER, kv=None))
    monkeypatch.setattr(ops, "endpoint_status", lambda: (ClusterStatus("e", rows), None))
    for name in ("decode-0", "prefill-0", "router", "decode-9"):
        ops._warn_if_last(name)
    warned = capsys.readouterr().err
    assert warned.startswith("warning: decode-0 is the only READY decode worker: the router pairs no request until "
                             "`dsv4-cluster restart decode-0`") and warned.count("warning") == 1, warned


def test_a_deep_probe_line_says_its_age_and_which_worker_is_down_since() -> None:
    """An 'ok' probe from before decode-0 failed must not read as the pair's health (probes run every 30 s)."""
    prefill = _row(name="prefill-0", role=Role.PREFILL)
    probe = ProbeResult("prefill-0", "decode-0", True, 0.05, at=time.time() - 12)
    down = render_table(ClusterStatus("e", (prefill, _row(state=WorkerState.FAILED, pid=None)), (probe,)))
    assert down.splitlines()[-1] == "deep probe prefill-0 -> decode-0: ok in 0.05s (12s ago); decode-0 is FAILED now"
    up = render_table(ClusterStatus("e", (prefill, _row()), (probe,)))
    assert up.splitlines()[-1] == "deep probe prefill-0 -> decode-0: ok in 0.05s (12s ago)"


def test_up_again_with_a_failed_process_names_it_and_exits_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """`up` on a running cluster starts nothing; with the router FAILED it said 'already up' and exited 0 while the
    endpoint refused connections. Now: the table, then which process is FAILED and how to start it again."""
    import argparse
    from types import SimpleNamespace

    from dsv4_cluster.orchestrator.cli import commands
    from dsv4_cluster.orchestrator.cluster.deployment import UpResult

    router = _row(name="router", role=Role.ROUTER, state=WorkerState.FAILED, pid=None, kv=None)
    status = ClusterStatus("http://localhost:30001/v1", (_row(name="prefill-0", role=Role.PREFILL), _row(), router))
    args = argparse.Namespace(file="topology.yaml", address=None, timeout=60.0, foreground=False)
    fake = SimpleNamespace(up=lambda path, options: UpResult(status, already_up=True))
    assert commands._cmd_up(fake, args) == commands.EXIT_FAILED
    out, err = capsys.readouterr()
    assert "already up from topology.yaml; nothing was started" in out and "FAILED" in out
    assert "FAILED: router; `dsv4-cluster restart NAME` starts one again" in err
    healthy = SimpleNamespace(up=lambda path, options: UpResult(ClusterStatus("e", (_row(),)), already_up=True))
    assert commands._cmd_up(healthy, args) == commands.EXIT_OK


def test_bench_prints_its_table_and_names_an_unwritable_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep that ran is never lost to a bad `--out`, and the operator sees why, not a traceback."""
    import argparse

    from dsv4_cluster.orchestrator.load import sweep

    level = dict(concurrency=1, requests=8, prompt_tokens_mean=204.0, max_tokens=64, output_tok_s=120.0,
                 decode_tok_s=121.0, ttft_p50_s=0.05, ttft_p99_s=0.08, tpot_p50_s=0.007, tpot_p99_s=0.008,
                 errors=0, errors_by_reason={})
    monkeypatch.setattr(sweep, "run_sweep", lambda url, options, progress: {"levels": [level]})
    parser = argparse.ArgumentParser()
    sweep.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "http://127.0.0.1:1", "--out", str(tmp_path)])   # a directory
    assert sweep.main(args) == 1
    out, err = capsys.readouterr()
    assert "| 1 | 8 | 204.0 | 64 | 120.0 |" in out
    assert f"cannot write the sweep's JSON to {tmp_path}" in err


def test_logs_refuses_a_negative_line_count(capsys: pytest.CaptureFixture[str]) -> None:
    """`logs NAME -n -3` printed nothing and exited 0; it is a usage error (exit 2), before any cluster lookup."""
    from dsv4_cluster.orchestrator.cli.commands import _parser

    assert _parser().parse_args(["logs", "decode-0", "-n", "0"]).lines == 0
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["logs", "decode-0", "-n", "-3"])
    assert exc.value.code == 2 and "give a number of lines, 0 or more" in capsys.readouterr().err


def test_down_with_a_record_it_cannot_read_fails_instead_of_saying_nothing_to_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A corrupt record said 'nothing to stop' and exited 0 while its cluster may run on; no record at all is still
    a clean no-op."""
    from dsv4_cluster.orchestrator.cli.commands import main

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    assert main(["down"]) == 0 and "nothing to stop" in capsys.readouterr().err
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "current.json").write_text("{not json")
    assert main(["down"]) == 1
    err = capsys.readouterr().err
    assert "cannot read the cluster record" in err and "remove it if no cluster is running" in err
    assert "nothing to stop" not in err


def test_exit_text_names_a_signal_instead_of_a_negative_code() -> None:
    from dsv4_cluster.orchestrator.processes import exit_text

    assert exit_text(3) == "exited with code 3" and exit_text(0) == "exited with code 0"
    assert exit_text(-9) == "was killed by SIGKILL" and exit_text(-15) == "was killed by SIGTERM"
    assert exit_text(-99) == "was killed by signal 99"


def test_record_round_trip_and_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    with pytest.raises(RecordError, match="no cluster is up"):
        read_record()
    rec = ClusterRecord("127.0.0.1:6379", "ns", "http://0.0.0.0:30001/v1", "/t.yaml", "/run",
                        HeadProcess(123, "/run/logs/ray-head.log"))
    write_record(rec)
    assert read_record() == rec
    (tmp_path / "home" / "current.json").write_text('{"address": 1}')
    with pytest.raises(RecordError, match="invalid"):
        read_record()
    clear_record()
    with pytest.raises(RecordError, match="no cluster is up"):
        read_record()


def test_logs_after_down_read_the_last_clusters_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`logs decode-0` after `down` said "no cluster is up" while its log lay on disk: at 3 a.m. that is when it is
    wanted."""
    from dsv4_cluster.orchestrator.cluster.operations import log_path

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    with pytest.raises(NotUpError, match=r"no cluster is up \(no .*current.json\); start one"):   # nothing known yet
        log_path("decode-0")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "decode-0.log").write_text("=== start\n")
    write_record(ClusterRecord("127.0.0.1:6379", "ns", "http://localhost:30001/v1", "/t.yaml", str(run), None))
    clear_record()                                              # what `down` does last
    path, note = log_path("decode-0")
    assert path == str(run / "logs" / "decode-0.log") and note.startswith("no cluster is up; the log of the last one")
    with pytest.raises(NotUpError, match=r"have none named 'router': \['decode-0'\]"):
        log_path("router")
    # `-f` on it prints it and ends: following a file nothing writes any more hung until Ctrl-C
    env = {**os.environ, HOME_ENV: str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "dsv4_cluster.orchestrator", "logs", "decode-0", "-f"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "=== start\n"), done.stderr
    assert "(not followed: nothing writes it any more):" in done.stderr, done.stderr
    # with no cluster recorded, `logs`, `status` and `down` answer without importing Ray (a second of CPU here)
    code = ("import contextlib, io, sys\n"
            "from dsv4_cluster.orchestrator.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    codes = [main(['logs', 'decode-0']), main(['status']), main(['down'])]\n"
            "print(codes, 'ray' in sys.modules)\n")
    quick = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert quick.stdout.strip() == "[0, 1, 0] False", quick.stdout + quick.stderr
    (tmp_path / "home" / "current.json").write_text('{"address": 1}')   # a record that cannot be read: say so,
    with pytest.raises(RecordError, match="is invalid"):                  # not an older cluster's log
        log_path("decode-0")


def test_a_dead_head_is_never_looked_up_at_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the Ray head `up` started is gone, another cluster's head may listen at its address: `status`, `down`
    and every operation say the cluster is gone instead of connecting there (a CI run once showed another test's
    cluster as this one's)."""
    from dsv4_cluster.orchestrator.cluster import deployment, ray_cluster
    from dsv4_cluster.orchestrator.errors import NotUpError

    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    dead.wait()
    connected: list[str] = []
    monkeypatch.setattr(ray_cluster, "connect", lambda address, namespace: connected.append(address))
    rec = ClusterRecord("127.0.0.1:6379", "ns", "http://0.0.0.0:30001/v1", "/t.yaml", "/run",
                        HeadProcess(dead.pid, "/run/logs/ray-head.log"))
    with pytest.raises(NotUpError, match=f"pid {dead.pid}.* is gone.*dsv4-cluster down"):
        deployment.find_controller(rec)
    monkeypatch.setattr(deployment, "read_record", lambda: rec)
    monkeypatch.setattr(deployment, "clear_record", lambda: None)
    gone = deployment.down(DownOptions(timeout_s=1))
    assert gone.survivors == [] and len(gone.notes) == 1, gone
    # `down` says what it found, without the advice to run `down` (it said "run `dsv4-cluster down` to clean up")
    assert "is gone, and the cluster with it" in gone.notes[0] and "dsv4-cluster down" not in gone.notes[0], gone
    assert connected == []


def test_a_head_that_exits_with_an_empty_log_says_so_instead_of_a_dangling_colon(tmp_path: Path) -> None:
    """`ray start --head` gone before its first line: the error ended in "<log path>:" and an empty line (or showed
    an earlier head's lines: the log is appended to, and this run's part starts at `offset`)."""
    from dsv4_cluster.orchestrator.cluster import ray_cluster
    from dsv4_cluster.orchestrator.errors import RayClusterError

    log = tmp_path / "ray-head.log"
    log.write_text("an earlier head's last line\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RayClusterError) as err:
        ray_cluster._wait_started(proc, log, log.stat().st_size, timeout_s=5)
    assert str(err.value) == f"`ray start --head` exited with code 3 ({log}) (the log is empty)"
    log.write_text("an earlier head's last line\nthis one's\n")
    with pytest.raises(RayClusterError, match="\nlast log lines:\nthis one's\n$"):
        ray_cluster._wait_started(proc, log, len("an earlier head's last line\n"), timeout_s=5)


def test_free_ports_are_free_and_below_the_ephemeral_range() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(20000 <= p < 32768 and port_is_free(p) for p in ports)


def test_free_ports_search_the_range_the_environment_gives(monkeypatch) -> None:
    """Parallel test workers (tests/conftest.py) and operators side by side each take a slice of their own."""
    from dsv4_cluster.orchestrator.launch.ports import PORTS_ENV, search_range

    monkeypatch.setenv(PORTS_ENV, "24000-24100")
    assert search_range() == (24000, 24100) and all(24000 <= p < 24100 for p in free_ports(20))
    monkeypatch.delenv(PORTS_ENV)
    assert search_range() == (20000, 32768)
    for bad, why in (("24000", "LOW-HIGH"), ("x-y", "LOW-HIGH"), ("30000-20000", "LOW < HIGH"), ("80-90", "1024")):
        monkeypatch.setenv(PORTS_ENV, bad)
        with pytest.raises(ValueError, match=why):
            free_ports(1)


def test_zombies_count_as_gone_and_groups_are_seen() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             start_new_session=True)
    try:
        assert pid_alive(child.pid) and group_members(child.pid) == [child.pid]
        child.kill()
        wait_for(lambda: not pid_alive(child.pid), 10, "the killed child to count as dead")  # a zombie, unreaped
        assert Path(f"/proc/{child.pid}").exists()  # still unreaped
        assert not pid_alive(child.pid) and group_members(child.pid) == []
    finally:
        child.kill()
        child.wait()


def test_kernel_problems_name_each_inactive_kernel() -> None:
    requested = ("sparse_mla_decode", "indexer", "topk")
    ok = {"kernels": {"sparse_mla_decode": "reference", "indexer": "triton", "topk": "reference"}}
    assert kernel_problems("p", requested, ok) == []
    bad = {"kernels": {"sparse_mla_decode": "off", "indexer": "triton"}}
    assert kernel_problems("p", requested, bad) == [
        "p: kernel sparse_mla_decode was requested but is 'off' in the worker",
        "p: kernel topk was requested but is 'missing' in the worker"]
    assert "reports no kernels" in kernel_problems("p", requested, {})[0]


def test_embedded_call_problems_judge_the_decode_worker_that_served() -> None:
    requested = ("sparse_mla_decode", "indexer", "topk")
    idle = Calls("cuda", {})
    before = {"d0": idle, "d1": idle}
    # d1 served the check on the GPU: every kernel rose as a kernel; d0 never ran -> not judged
    ran = Calls("cuda", {"sparse_mla_decode": {"gluon": 64}, "indexer": {"triton": 64}, "topk": {"triton": 64}})
    assert call_problems(requested, before, {"d0": idle, "d1": ran}) == (
        [], ["d1 ran sparse_mla_decode, indexer, topk as our kernels during the PD check"])
    # on the GPU a kernel that ran only as the reference op is a problem that says what ran
    ref = Calls("cuda", {"sparse_mla_decode": {"gluon": 64}, "indexer": {"reference": 64}, "topk": {"triton": 64}})
    problems, notes = call_problems(requested, before, {"d0": idle, "d1": ref})
    assert problems == ["d1: kernel indexer was not called during the PD check's decode steps "
                        "(calls 0 -> 0; what ran: {'reference': 64})"] and notes == []
    # on the CPU the reference ops are what runs
    cpu = Calls("cpu", {k: {"reference": 16} for k in requested})
    assert call_problems(requested, {"d0": Calls("cpu", {})}, {"d0": cpu})[0] == []
    # nothing rose anywhere, or a worker that cannot be read
    assert call_problems(requested, before, before)[0] == [
        "no decode worker's kernel counters rose during the PD check's decode steps"]
    assert call_problems(requested, {"d0": "d0: cannot read"}, {"d0": idle})[0] == ["d0: cannot read"]


def test_preflight_lists_every_machine_problem_of_the_production_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4_cluster.orchestrator.launch import preflight
    from dsv4_cluster.orchestrator.topology.load import load_topology

    topo = load_topology(Path(__file__).resolve().parents[2] / "topology.yaml")
    monkeypatch.setattr(preflight, "_visible_gpus", lambda: 4)
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    monkeypatch.setattr(preflight, "NUMA_SYSFS", "/nonexistent")
    problems = preflight.machine_problems(topo)
    assert "decode-0: wants GPUs [4, 5, 6, 7] but this machine shows 4 CUDA device(s)" in "\n".join(problems)
    assert not any(p.startswith("prefill-0: wants GPUs") for p in problems)
    assert sum("numa_node" in p and "does not exist" in p for p in problems) == 2
    assert any("`numactl` is not installed" in p for p in problems)


def test_only_a_loopback_cluster_keeps_ray_drivers_on_loopback() -> None:
    from dsv4_cluster.orchestrator.cluster.ray_env import is_loopback

    assert is_loopback(None) and is_loopback("127.0.0.1:6379") and is_loopback("localhost:1")
    assert not is_loopback("10.1.2.3:6379") and not is_loopback("head.example:6379")


def test_port_holders_name_the_process_on_the_port():
    import os
    import socket

    from dsv4_cluster.orchestrator.launch.port_owner import port_holders
    from dsv4_cluster.orchestrator.launch.ports import free_ports

    port = free_ports(1)[0]
    assert port_holders(port) == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        holders = port_holders(port)
    assert len(holders) == 1 and holders[0].startswith(f"pid {os.getpid()} (")


def test_stranded_kv_is_read_from_metrics_and_absent_when_not_exported() -> None:
    from dsv4_cluster.core import StrandedKv
    from dsv4_cluster.orchestrator.readback.stranded import parse_stranded_kv, stranded_line

    page = ('dsv4_stranded_kv_tokens{engine_type="prefill"} 64.0\ndsv4_stranded_kv_rooms{engine_type="prefill"} 2.0\n'
            'dsv4_stranded_kv_freed_tokens_total{engine_type="prefill"} 128.0\n'
            'dsv4_stranded_kv_freed_rooms_total{engine_type="prefill"} 3.0\nsglang:num_used_tokens 64.0\n')
    numbers = parse_stranded_kv(page)
    assert numbers == StrandedKv(tokens=64, rooms=2, freed_tokens=128, freed_rooms=3)
    assert stranded_line(_row(name="prefill-0", stranded_kv=numbers)) == (
        "prefill-0: stranded KV 64 tokens in 2 rooms now; freed 128 tokens in 3 rooms since it started")
    one = StrandedKv(tokens=1, rooms=1, freed_tokens=0, freed_rooms=0)   # "1 rooms" before: singular when one
    assert stranded_line(_row(name="prefill-0", stranded_kv=one)) == (
        "prefill-0: stranded KV 1 token in 1 room now; freed 0 tokens in 0 rooms since it started")
    assert parse_stranded_kv("sglang:num_used_tokens 64.0\n") is None  # SGLang: nothing measured, nothing shown
    assert stranded_line(_row(name="prefill-0")) is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the drop itself
def test_a_sigterm_whose_raise_python_drops_still_interrupts_up() -> None:
    """A signal handler's exception raised inside a weakref callback is printed and dropped by Python (CI saw
    SIGTERM land in importlib's module-lock callback: `up` finished and exited 0); `up` checks the flag after."""
    import signal
    import weakref

    from dsv4_cluster.orchestrator.cluster import deployment

    class Obj:
        pass

    deployment._INTERRUPTED.clear()
    deployment._check_interrupt()                       # nothing arrived: no interrupt
    obj = Obj()
    ref = weakref.ref(obj, lambda _: deployment._raise_interrupt(signal.SIGTERM, None))
    del obj                                             # the callback raises; Python drops it
    assert ref() is None
    with pytest.raises(KeyboardInterrupt, match="signal SIGTERM during up"):
        deployment._check_interrupt()
    deployment._INTERRUPTED.clear()


def test_status_watch_ctrl_c_ends_a_read_under_way() -> None:
    """One read may wait 30 s on the endpoint and then on Ray; Ctrl-C during it exits at once with 0."""
    import signal
    import threading

    from dsv4_cluster.orchestrator.cli.ops import watch_status

    started = threading.Event()

    def slow_read() -> dict:
        started.set()
        time.sleep(60)
        raise AssertionError("the read was not interrupted")

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Aimed at the main thread, as a terminal's Ctrl-C lands: os.kill() from this thread may hand the
    # signal to another thread, and then the main thread's sleep is not interrupted (CPython runs the
    # handler only when the main thread next executes bytecode).
    # Pressed again every 0.5 s until the read ends, as a user would: one signal can land before the read is under
    # way (seen once in 2-worker CI); a watch that ignored Ctrl-C during reads still waits the whole 60 s.
    main, done = threading.main_thread().ident, threading.Event()

    def ctrl_c() -> None:
        started.wait(10)
        while not done.is_set():
            signal.pthread_kill(main, signal.SIGINT)
            done.wait(0.5)
    killer = threading.Thread(target=ctrl_c)
    killer.start()
    try:
        t0 = time.monotonic()
        assert watch_status(slow_read, 0.5) == 0
        assert time.monotonic() - t0 < 10
    finally:
        done.set()
        killer.join()
        for sig, handler in old.items():
            signal.signal(sig, handler)
