"""`dsv4-cluster up/status/down` end to end: the real CLI in its own process, a real Ray head,
the real embedded prefill and decode workers and the real router, on free loopback ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from dsv4_cluster.orchestrator.launch.ports import port_is_free
from dsv4_cluster.orchestrator.processes import group_members, pid_alive

from tests.helpers import STATUS_POLL_S, gone, wait_for
from bench.local_cluster import CLI, run_cli, write_topology

pytestmark = pytest.mark.slow


def _topology(tmp_path: Path, extra_decode: str = "", kernels: bool = False) -> tuple[Path, dict[str, int]]:
    cluster = write_topology(tmp_path, extra_decode=extra_decode, kernels=kernels)
    return cluster.topology, cluster.ports


def _run(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_cli(tmp_path / "home", *args, timeout=timeout)


def _head_pid(tmp_path: Path) -> int:
    return json.loads((tmp_path / "home" / "current.json").read_text())["head"]["pid"]


def test_up_status_chat_down(tmp_path: Path) -> None:
    topo, ports = _topology(tmp_path, kernels=True)  # up verifies each is active
    up = _run(tmp_path, "up", str(topo), "--timeout", "180")
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        assert f"endpoint: http://127.0.0.1:{ports['router']}/v1" in up.stdout
        head = _head_pid(tmp_path)
        other = tmp_path / "other.yaml"
        other.write_text(topo.read_text())
        again = _run(tmp_path, "up", str(other))
        assert again.returncode == 1 and "already up" in again.stderr, again.stderr
        assert "nothing was started" in again.stderr

        st = _run(tmp_path, "status", "--json")
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        rows = {w["name"]: w for w in status["workers"]}
        assert list(rows) == ["prefill-0", "decode-0", "router"]
        for name, role, port in [("prefill-0", "prefill", ports["prefill"]),
                                 ("decode-0", "decode", ports["decode"]),
                                 ("router", "router", ports["router"])]:
            row = rows[name]
            assert (row["role"], row["state"], row["restarts"], row["port"]) == (role, "READY", 0, port)
            assert pid_alive(row["pid"])
        for name in ("prefill-0", "decode-0"):
            assert (rows[name]["kv_capacity_tokens"], rows[name]["kv_used_tokens"]) == (4096, 0)
            assert rows[name]["kv_predicted_tokens"] == 4096 and not rows[name].get("error")  # capacity.py
            assert rows[name]["kernels"] == {"indexer": "reference", "sparse_mla_decode": "reference",
                                             "topk": "reference"}
        assert rows["router"]["kv_capacity_tokens"] is None

        table = _run(tmp_path, "status").stdout.splitlines()
        assert table[0].split() == ["NAME", "ROLE", "NODE", "PID", "STATE", "RESTARTS", "PORT",
                                    "KV_CAPACITY", "KV_USED", "KV_PREDICTED"]
        assert table[1].split() == ["prefill-0", "prefill", "local", str(rows["prefill-0"]["pid"]),
                                    "READY", "0", str(ports["prefill"]), "4096", "0", "4096"]

        reply = httpx.post(f"http://127.0.0.1:{ports['router']}/v1/chat/completions", timeout=120,
                           json={"model": "dsv4-tiny", "max_tokens": 4, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4

        assert "verified: " in up.stdout and " tok/s" in up.stdout  # up ran verify, throughput probe included
        up_rows = {line.split()[0]: line.split() for line in up.stdout.splitlines() if line.startswith(("prefill-0 ",
                                                                                                        "decode-0 "))}
        assert up_rows["prefill-0"][-1] == up_rows["decode-0"][-1] == "4096"  # up's table predicts too
        # KV_USED: read before the deep probe's first request, and counted as SGLang does (cached KV is not used)
        assert up_rows["prefill-0"][-2] == up_rows["decode-0"][-2] == "0", up.stdout
        verify = _run(tmp_path, "verify")  # on demand: PD equivalence again, and vs up's stored throughput
        assert verify.returncode == 0 and verify.stdout.startswith("verified: "), verify.stdout + verify.stderr
        # the decode worker's call counters rose during the check (CPU: the reference ops; embedded_calls.py)
        assert ("decode-0 ran sparse_mla_decode, indexer, topk as the reference ops (CPU: no kernels) during the PD "
                "check") in verify.stdout, verify.stdout
        assert json.loads((topo.parent / "run" / "last-good-throughput.json").read_text())["tokens_per_s"] > 0

        os.kill(rows["decode-0"]["pid"], signal.SIGKILL)  # a crash: the supervisor restarts it
        def restarted() -> dict | None:
            row = json.loads(_run(tmp_path, "status", "--json").stdout)["workers"][1]
            return row if (row["restarts"], row["state"]) == (1, "READY") else None
        decode = wait_for(restarted, 90, "decode-0 READY after 1 restart", interval_s=STATUS_POLL_S)
        assert decode["pid"] != rows["decode-0"]["pid"]
        rows["decode-0-restarted"] = decode
    finally:
        down = _run(tmp_path, "down", "--timeout", "10")
    assert down.returncode == 0, down.stderr + down.stdout
    assert gone([row["pid"] for row in rows.values()] + [head]) == []
    assert port_is_free(ports["router"])
    assert not (tmp_path / "home" / "current.json").exists()
    after = _run(tmp_path, "status")
    assert after.returncode == 1 and "no cluster is up" in after.stderr
    logs = _run(tmp_path, "logs", "decode-0", "-n", "100000")   # its logs outlive it: read at 3 a.m. after a down
    assert logs.returncode == 0 and "no cluster is up; the log of the last one, stopped at" in logs.stderr, logs.stderr
    assert logs.stdout.count("supervisor starts") == 2, logs.stdout[-3000:]   # the first start, then the restart
    none = _run(tmp_path, "logs", "decode-9")
    assert none.returncode == 1 and "have none named 'decode-9'" in none.stderr and "'decode-0'" in none.stderr


def test_broken_topology_lists_every_problem_and_starts_nothing(tmp_path: Path) -> None:
    topo = tmp_path / "bad.yaml"
    topo.write_text("engine: vllm\nmodel: {name: x, context_length: 0}\nprefill: []\n"
                    "decode:\n  - {name: Decode_0, port: 70000}\n")
    started = time.monotonic()
    r = _run(tmp_path, "up", str(topo))
    assert r.returncode == 2
    assert "nothing was started" in r.stderr
    for field in ("engine", "model.context_length", "prefill", "decode[0].name", "decode[0].port"):
        assert f" {field}:" in r.stderr, (field, r.stderr)
    assert time.monotonic() - started < 20
    assert not (tmp_path / "home").exists()
    assert not (tmp_path / "run").exists()


def test_up_fails_when_decode_disagrees_with_a_single_process_run(tmp_path: Path) -> None:
    """A decode worker with other weights (seed 1) is a wrong PD pair: up's check must catch it."""
    topo, ports = _topology(tmp_path, extra_decode=", extra_args: [--seed, '1']")
    r = _run(tmp_path, "up", str(topo), "--timeout", "120")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "differ from a single-process run" in r.stderr
    assert "everything it started was stopped" in r.stderr
    assert not (tmp_path / "home" / "current.json").exists()
    for port in ports.values():
        assert port_is_free(port), port


def test_port_in_use_is_a_preflight_problem(tmp_path: Path) -> None:
    topo, ports = _topology(tmp_path)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", ports["decode"]))
        busy.listen()
        r = _run(tmp_path, "up", str(topo))
    assert r.returncode == 2, r.stderr
    assert f"decode-0: port {ports['decode']} is in use on this machine by pid {os.getpid()} (" in r.stderr
    assert not (tmp_path / "home").exists() and not (tmp_path / "run").exists()   # preflight made no folder


def test_a_worker_that_cannot_start_fails_up_and_leaves_nothing(tmp_path: Path) -> None:
    topo, ports = _topology(tmp_path, extra_decode=", extra_args: [--no-such-flag]")
    r = _run(tmp_path, "up", str(topo), "--timeout", "120")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "decode-0" in r.stderr and "--no-such-flag" in r.stderr
    assert "everything it started was stopped" in r.stderr
    assert not (tmp_path / "home" / "current.json").exists()
    head_log = (tmp_path / "run" / "logs" / "ray-head.log").read_text()
    assert "Ray runtime started" in head_log
    for port in ports.values():
        assert port_is_free(port), port


def test_foreground_on_a_joined_cluster_ignores_a_stale_record_and_stops_on_sigterm_leaving_the_head(
        tmp_path: Path) -> None:
    """`up --foreground` on a Ray head it did not start (what systemd runs). While it serves, a stale record (a cluster
    whose controller died for good, in the same Ray namespace) must not take this cluster's controller for its own:
    its `status` and `down` say so, and its `down` stops nothing. Then SIGTERM stops the cluster and leaves the head."""
    from dsv4_cluster.orchestrator.cluster.ray_cluster import head_alive, start_head, stop_head

    address, head = start_head(tmp_path / "head.log", num_cpus=1, timeout_s=60)
    try:
        topo, ports = _topology(tmp_path)
        env = {**os.environ, "DSV4_CLUSTER_HOME": str(tmp_path / "home")}
        proc = subprocess.Popen([*CLI, "up", str(topo), "--address", address, "--foreground", "--timeout", "180"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("router"):
                    break
            assert any(f"127.0.0.1:{ports['router']}/v1" in ln for ln in lines), lines
            table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("NAME")) + 1:]
            pids = [int(ln.split()[3]) for ln in table]     # NAME ROLE NODE PID ...
            assert len(pids) == 3
            record = json.loads((tmp_path / "home" / "current.json").read_text())
            assert record["head"] is None   # joined: the same address and namespace as the stale one's

            before = json.loads(_run(tmp_path, "status", "--json").stdout)["workers"]
            ask = {"model": "dsv4-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                   "temperature": 0}
            answer = httpx.post(record["endpoint"] + "/chat/completions", json=ask, timeout=60)
            assert answer.status_code == 200, answer.text
            stale = tmp_path / "stale" / "home"
            stale.mkdir(parents=True)
            record.update(admin_token="the-token-of-an-earlier-up", run_dir=str(tmp_path / "stale" / "run"),
                          topology_path=str(tmp_path / "stale" / "topology.yaml"))
            (stale / "current.json").write_text(json.dumps(record))
            st = run_cli(stale, "status")
            assert st.returncode == 1 and "belongs to another cluster" in st.stderr, st.stdout + st.stderr
            down = run_cli(stale, "down")
            assert down.returncode == 0 and "belongs to another cluster" in down.stderr, down.stderr
            assert "supervisors killed" not in down.stderr and not (stale / "current.json").exists()
            after = json.loads(_run(tmp_path, "status", "--json").stdout)["workers"]
            assert [(w["name"], w["pid"], w["state"]) for w in after] == \
                [(w["name"], w["pid"], w["state"]) for w in before]
            assert all(w["state"] == "READY" for w in after), after
            again = httpx.post(record["endpoint"] + "/chat/completions", json=ask, timeout=60)  # it serves on, the same
            assert again.status_code == 200 and again.json()["choices"] == answer.json()["choices"], again.text

            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, err     # 0: its watch never saw the cluster go away before the signal
        assert "no process left" in out
        assert gone(pids) == []
        assert all(port_is_free(p) for p in ports.values())
        assert head_alive(head), "down stopped a Ray head that up did not start"
    finally:
        if (tmp_path / "home" / "current.json").exists():   # an assertion above failed while the cluster was up
            _run(tmp_path, "down")
        stop_head(head, deadline_s=10)
    assert not head_alive(head)


def test_sigterm_during_up_stops_what_up_started(tmp_path: Path) -> None:
    topo, ports = _topology(tmp_path)
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([*CLI, "up", str(topo)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        record = tmp_path / "home" / "current.json"
        wait_for(lambda: record.exists() or proc.poll() is not None, 60, "up to write its record")
        head = _head_pid(tmp_path)  # the record exists once the controller is being created
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "everything it started was stopped" in err
    assert gone([head]) == [] and not record.exists()
    assert all(port_is_free(p) for p in ports.values())


def test_a_killed_ray_head_takes_every_process_with_it_and_down_cleans_up(tmp_path: Path) -> None:
    topo, ports = _topology(tmp_path)
    up = _run(tmp_path, "up", str(topo), "--timeout", "180")
    assert up.returncode == 0, up.stderr
    pids = [w["pid"] for w in json.loads(_run(tmp_path, "status", "--json").stdout)["workers"]]
    head = _head_pid(tmp_path)
    os.killpg(head, signal.SIGKILL)
    assert gone(pids + [head], timeout_s=30) == []  # supervisors die, PR_SET_PDEATHSIG does the rest
    # bounded, not at once: one CI run's `status`, right after the kill, still found a process in the head's group
    # and served the deep probe (cause not found: a supervisor restarting its worker as it died is one candidate)
    st = wait_for(lambda: (r := _run(tmp_path, "status")).returncode == 1 and r, 60, "status to report the head gone",
                  interval_s=STATUS_POLL_S)
    assert "is gone" in st.stderr and "dsv4-cluster down" in st.stderr
    down = _run(tmp_path, "down")
    assert down.returncode == 0, down.stderr
    assert not (tmp_path / "home" / "current.json").exists()
    assert all(port_is_free(p) for p in ports.values())


def test_a_node_missing_from_ray_fails_up_before_any_process_starts(tmp_path: Path) -> None:
    topo, ports = _topology(tmp_path)
    text = topo.read_text().replace("decode:\n  - {", "decode:\n  - {node: far, ")
    topo.write_text(text + "nodes:\n  - {name: local, address: 127.0.0.1}\n"
                           "  - {name: far, address: 10.255.0.9}\n")
    r = _run(tmp_path, "up", str(topo))
    assert r.returncode == 2, r.stdout + r.stderr        # found before a Ray head starts: no machine joins a new one
    assert "cannot start on this machine; nothing was started:\n" in r.stderr, r.stderr
    problems = r.stderr.split("nothing was started:\n")[1].strip().splitlines()   # decode-0's only: the rest is local
    assert len(problems) == 1 and problems[0].startswith("decode-0: node 'far' (10.255.0.9) is not this machine at "
                                                         "127.0.0.1, the only node of the Ray head `up` starts"), problems
    assert not (tmp_path / "run" / "logs" / "prefill-0.log").exists()
    assert not (tmp_path / "run" / "logs" / "ray-head.log").exists()
    assert not (tmp_path / "home" / "current.json").exists()


def test_the_ray_head_leaves_the_topologys_ports_to_the_topology(tmp_path: Path, monkeypatch) -> None:
    """`up` starts its Ray head before the workers and the router bind their ports; the head's five ports must avoid
    them (seen in CI: a head's port on the router's, and the router crash-looped on the bind). A real head in a
    window of six free ports with one reserved takes the other five; `up` reserves every port of its plans."""
    from dsv4_cluster.orchestrator.cluster import deployment, ray_cluster
    from dsv4_cluster.orchestrator.launch.ports import search_range

    low, high = search_range()
    start = next(p for p in range(low, high - 6) if all(port_is_free(q) for q in range(p, p + 6)))
    window, reserved = range(start, start + 6), start + 3
    monkeypatch.setenv("DSV4_CLUSTER_PORTS", f"{start}-{start + 6}")
    _, head = ray_cluster.start_head(tmp_path / "head.log", num_cpus=1, timeout_s=60, reserved=frozenset({reserved}))
    try:
        argv = Path(f"/proc/{head.pid}/cmdline").read_bytes().split(b"\0")
        taken = {int(a) for a in argv if a.isdigit() and int(a) in window}
        assert taken == set(window) - {reserved}, (taken, reserved)
        # and no Ray Client server among its processes (a port that runs any code sent to it; nothing uses it)
        wait_for(lambda: len(group_members(head.pid)) >= 6, 30, "the head's raylet and its agents")
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in group_members(head.pid)]
        assert not [c for c in commands if b"ray.util.client.server" in c], commands
    finally:
        ray_cluster.stop_head(head, deadline_s=10.0)
    assert not gone([head.pid])

    asked: list[frozenset[int]] = []

    def no_head(log_path, num_cpus, timeout_s, reserved=frozenset()):
        asked.append(reserved)
        raise ray_cluster.RayClusterError("stopped here by the test")

    monkeypatch.setattr(ray_cluster, "start_head", no_head)
    monkeypatch.setenv("DSV4_CLUSTER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSV4_CLUSTER_PORTS")
    topo, ports = _topology(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)  # `up` installs its own while it starts things
    try:
        with pytest.raises(ray_cluster.RayClusterError, match="stopped here by the test"):
            deployment.up(str(topo), deployment.UpOptions())
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert asked and set(ports.values()) <= asked[0], (ports, asked)
