"""Operations on a running embedded cluster through the real CLI: idempotent `up`, `drain` under
steady load (no request lost), `restart`, `logs [-f]`, `status --watch`. One cluster (1 prefill,
2 decode) for the module."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest


from bench.local_cluster import CLI, LocalCluster
from dsv4_cluster.orchestrator.monitor.targets import listed, targets_dir
from dsv4_cluster.orchestrator.topology.load import load_topology
from tests.helpers import status_rows, wait_for, wait_for_async

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(local_cluster) -> LocalCluster:
    with local_cluster("ops", decodes=2) as c:
        yield c


def _admin(c: LocalCluster, name: str) -> dict:
    token = json.loads((c.home / "current.json").read_text())["admin_token"]
    r = httpx.get(c.router_url + "/admin/workers", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return next(w for w in r.json()["workers"] if w["name"] == name)


def test_up_again_reports_the_running_cluster_and_starts_nothing(cluster):
    pids = {n: r["pid"] for n, r in status_rows(cluster).items()}
    again = cluster.cli("up", str(cluster.topology))
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stdout and "nothing was started" in again.stdout
    assert {n: r["pid"] for n, r in status_rows(cluster).items()} == pids
    assert (cluster.home / "current.json").stat().st_mode & 0o077 == 0   # it holds the admin token


async def _steady_load(c: LocalCluster, stop: asyncio.Event, out: list) -> None:
    async def lane(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            try:
                r = await client.post(c.router_url + "/v1/chat/completions", json={
                    "model": "dsv4-tiny", "max_tokens": 16, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "steady"}]})
                out.append(r.status_code if r.status_code != 200 else r.json()["usage"]["completion_tokens"])
            except httpx.HTTPError as e:
                out.append(type(e).__name__)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(lane(client) for _ in range(3)))


def test_drain_under_steady_load_loses_no_request_and_restart_brings_it_back(cluster):
    async def run() -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, list]:
        stop, out = asyncio.Event(), []
        load = asyncio.ensure_future(_steady_load(cluster, stop, out))

        async def answered(n: int) -> None:  # until the steady load has had n answers in all
            await wait_for_async(lambda: len(out) >= n, 120, f"{n} answers of the steady load (so far: {out})")

        await answered(4)
        drained = await asyncio.to_thread(cluster.cli, "drain", "decode-1", "--deadline", "60")
        targets.append(listed(_run_dir(cluster)))
        served_while_drained = len(out)
        await answered(served_while_drained + 3)  # decode-0 alone serves on
        restarted = await asyncio.to_thread(cluster.cli, "restart", "decode-1", "--timeout", "120")
        targets.append(listed(_run_dir(cluster)))
        await answered(len(out) + 3)  # and with decode-1 back
        stop.set()
        await load
        assert len(out) > served_while_drained
        return drained, restarted, out

    targets: list[set[str]] = []   # what Prometheus scrapes after the drain, after the restart
    drained, restarted, out = asyncio.run(run())
    everyone = {"prefill-0", "decode-0", "decode-1", "router"}
    assert targets == [everyone - {"decode-1"}, everyone]
    assert drained.returncode == 0, drained.stderr + drained.stdout
    assert "warning" not in drained.stderr, drained.stderr   # decode-0 still serves: nothing to warn of
    # under load the drain may find requests in flight: they finish, and the message says how many and how long
    assert re.search(r"decode-1 drained and stopped \((no request in flight|its \d+ request\(s\) in flight finished "
                     r"in \d+\.\ds)\)", drained.stdout), drained.stdout
    assert restarted.returncode == 0, restarted.stderr + restarted.stdout
    assert out and all(r == 16 for r in out), out   # every request of the steady load completed
    rows = status_rows(cluster)
    assert rows["decode-1"]["state"] == "READY" and rows["decode-1"]["restarts"] == 1
    states = [e["state"] for e in rows["decode-1"]["history"] if e["event"] == "state"]
    assert ["DRAINING", "STOPPED"] == states[states.index("STOPPED") - 1:states.index("STOPPED") + 1], states
    entry = _admin(cluster, "decode-1")
    assert (entry["state"], entry["drained"], entry["eligible"]) == ("READY", False, True)
    log = Path(rows["decode-1"]["log_path"]).read_text()
    assert log.count("supervisor starts") == 2


def test_the_router_restarts_by_name_and_serves_the_same_answers_again(cluster):
    """`restart router` (what brings a FAILED router back without `down` and `up`): a new router process, READY,
    and the same greedy answer through it once the supervisors have told it their workers' states."""
    def ask() -> httpx.Response:
        return httpx.post(cluster.router_url + "/v1/chat/completions", timeout=60, json={
            "model": "dsv4-tiny", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "again"}]})

    first = ask()
    assert first.status_code == 200, first.text
    pid = status_rows(cluster)["router"]["pid"]
    drained = cluster.cli("drain", "decode-1")   # stopped: its supervisor tells a new router nothing
    assert drained.returncode == 0, drained.stderr + drained.stdout
    restarted = cluster.cli("restart", "router", "--timeout", "60")
    assert restarted.returncode == 0, restarted.stderr + restarted.stdout
    assert "router restarted: READY" in restarted.stdout
    row = status_rows(cluster)["router"]
    assert row["state"] == "READY" and row["pid"] not in (None, pid)
    stopped = _admin(cluster, "decode-1")   # the controller told the new router: not paired
    assert (stopped["state"], stopped["eligible"]) == ("STOPPED", False), stopped
    answers: list[httpx.Response] = []
    wait_for(lambda: answers.append(ask()) or answers[-1].status_code == 200, 30, "an answer through the new router")
    assert answers[-1].json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    back = cluster.cli("restart", "decode-1", "--timeout", "120")
    assert back.returncode == 0, back.stderr + back.stdout
    assert _admin(cluster, "decode-1")["eligible"]


def test_logs_print_and_follow(cluster):
    shown = cluster.cli("logs", "decode-0", "-n", "100000")
    assert shown.returncode == 0, shown.stderr
    assert "ready to roll" in shown.stdout
    unknown = cluster.cli("logs", "decode-9")
    assert unknown.returncode == 1 and "decode-9" in unknown.stderr and "decode-0" in unknown.stderr
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(cluster.home)}
    follow = subprocess.Popen([*CLI, "logs", "decode-0", "-f", "-n", "0"], env=env, stdout=subprocess.PIPE,
                              text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in follow.stdout], daemon=True)
    reader.start()
    try:
        # Nothing old is printed (-n 0); what the worker logs from now on is: uvicorn logs each request
        # (but the supervisor's /health polls: workers/http/serving.py keeps them out).
        def printed() -> bool:
            httpx.get(f"http://127.0.0.1:{cluster.ports['decode-0']}/v1/models", timeout=10)
            try:
                return "/v1/models" in lines.get(timeout=1.0)
            except queue.Empty:
                return False
        wait_for(printed, 30, "logs -f to print the request it just served", interval_s=0)
        follow.send_signal(signal.SIGINT)
        assert follow.wait(30) == 0
    finally:
        follow.kill()
        follow.wait()


def test_status_watch_refreshes_until_interrupted(cluster):
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(cluster.home)}
    watch = subprocess.Popen([*CLI, "status", "--watch", "--interval", "0.5"], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        tables = 0
        while tables < 2:
            line = watch.stdout.readline()
            assert line, "status --watch ended by itself"
            assert "\x1b[" not in line, "a clear-screen code in piped output"   # only a terminal gets them
            tables += "NAME" in line and "STATE" in line
        watch.send_signal(signal.SIGINT)
        assert watch.wait(30) == 0
    finally:
        watch.kill()


def _run_dir(c: LocalCluster) -> Path:
    return load_topology(c.topology).run_dir_path


def test_reading_status_writes_no_scrape_targets(cluster):
    tdir = targets_dir(_run_dir(cluster))
    assert listed(_run_dir(cluster)) == set(status_rows(cluster))   # up listed every process
    for f in tdir.glob("*.json"):
        f.unlink()
    assert cluster.cli("status").returncode == 0 and status_rows(cluster)
    assert list(tdir.glob("*.json")) == []   # status is read, never written back
