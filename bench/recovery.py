"""Recovery benchmark: seconds from SIGKILL of a worker (or of its supervisor actor's process) to the
first successful request after it.

    python -m bench.recovery [--repeats 3] [--out bench/results/recovery]

Brings up a copy of the embedded cluster (1 prefill + 1 decode, free loopback ports) with the real
CLI, then for each worker and repeat: SIGKILL its pid (from `status`), send a 2-token chat request
through the router every 0.2 s, and record the time to the first 200 and to `status` saying READY
again. The same for the supervisor actor of each worker (its pid from the run folder's
`actors/supervisor-<name>.json`): Ray restarts the actor, which starts the worker again (the worker
died with it). The baseline, measured in the same run: the cold start of the same worker (a fresh process
of that role, spawn to `/health` 200), so `ratio` = recovery / cold start shows what supervision
adds (detection, backoff, re-registration) on top of starting the process. Target: <= 15 s.
Writes <out>.json and <out>.md (a table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.local_cluster import embedded_topology
from dsv4_cluster.orchestrator.launch.ports import free_ports

CLI = [sys.executable, "-m", "dsv4_cluster.orchestrator"]
RESULTS = Path(__file__).resolve().parent / "results"
TARGET_S = 15.0
REQUEST = {"model": "dsv4-tiny", "max_tokens": 2, "ignore_eos": True,
           "messages": [{"role": "user", "content": "are you back?"}]}


def _cli(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(home)}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _rows(home: Path) -> dict[str, dict]:
    st = _cli(home, "status", "--json")
    if st.returncode != 0:
        raise RuntimeError(f"status failed: {st.stderr}")
    return {w["name"]: w for w in json.loads(st.stdout)["workers"]}


def _ok(client: httpx.Client, url: str) -> bool:
    try:
        return client.post(url, json=REQUEST).status_code == 200
    except httpx.HTTPError:
        return False


def recover_once(home: Path, router_url: str, name: str, run_dir: Path | None = None,
                 limit_s: float = 120.0) -> dict:
    """SIGKILL worker `name` (or, given `run_dir`, its supervisor actor's process) and time the recovery."""
    url = router_url + "/v1/chat/completions"
    with httpx.Client(timeout=10) as client:
        if not _ok(client, url):
            raise RuntimeError("the cluster does not serve before the kill")
        before = _rows(home)[name]
        record = run_dir / "actors" / f"supervisor-{name}.json" if run_dir is not None else None
        os.kill(json.loads(record.read_text())["pid"] if record is not None else before["pid"], signal.SIGKILL)
        killed = time.monotonic()
        first_ok = None
        while time.monotonic() - killed < limit_s:
            if _ok(client, url):
                first_ok = time.monotonic() - killed
                break
            time.sleep(0.2)
    ready_at = None
    while time.monotonic() - killed < limit_s:
        row = _rows(home)[name]
        if row["state"] == "READY" and row["restarts"] == before["restarts"] + 1:
            ready_at = time.monotonic() - killed
            break
        time.sleep(0.2)
    killed_what = name if run_dir is None else f"supervisor of {name}"
    return {"worker": killed_what, "first_success_s": first_ok, "status_ready_by_s": ready_at}


def cold_start(role: str) -> float:
    """Spawn a fresh worker of `role` on free ports; seconds until its /health answers 200."""
    port, boot = free_ports(2)
    argv = [sys.executable, "-m", f"dsv4_cluster.workers.{role}", "--host", "127.0.0.1", "--port", str(port),
            "--max-total-tokens", "4096", "--context-length", "512"]
    if role == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(boot)]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the {role} worker exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)


def table(rows: list[dict]) -> str:
    lines = ["| killed | recovery median (s) | max (s) | status READY by, median (s) | cold start (s) | "
             "recovery / cold start | <= 15 s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['worker']} | {r['median_s']:.2f} | {r['max_s']:.2f} | {r['ready_median_s']:.2f} | "
                     f"{r['cold_start_s']:.2f} | {r['ratio']:.2f} | {'yes' if r['max_s'] <= TARGET_S else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "recovery"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dsv4-recovery-") as tmp:
        home = Path(tmp) / "home"
        topology, ports = embedded_topology(Path(tmp), "dsv4-bench-recovery")
        up = _cli(home, "up", str(topology), "--timeout", "180")
        if up.returncode != 0:
            print(up.stderr, file=sys.stderr)
            return 1
        try:
            router_url = f"http://127.0.0.1:{ports['router']}"
            run_dir = topology.parent / "run"
            runs = [recover_once(home, router_url, name, actor) for actor in (None, run_dir)
                    for name in ("decode-0", "prefill-0") for _ in range(args.repeats)]
        finally:
            down = _cli(home, "down", "--timeout", "10")
            if down.returncode != 0:
                print(down.stderr, file=sys.stderr)
    failed = [r for r in runs if r["first_success_s"] is None]
    if failed:
        print(f"no successful request after the kill within the limit: {failed}", file=sys.stderr)
        return 1
    rows = []
    cold = {role: statistics.median(cold_start(role) for _ in range(args.repeats)) for role in ("decode", "prefill")}
    for name, role in (("decode-0", "decode"), ("prefill-0", "prefill"), ("supervisor of decode-0", "decode"),
                       ("supervisor of prefill-0", "prefill")):
        times = [r["first_success_s"] for r in runs if r["worker"] == name]
        ready = [r["status_ready_by_s"] for r in runs if r["worker"] == name and r["status_ready_by_s"] is not None]
        median = statistics.median(times)
        rows.append({"worker": name, "median_s": median, "max_s": max(times), "runs_s": times,
                     "ready_median_s": statistics.median(ready) if ready else float("nan"),
                     "cold_start_s": cold[role], "ratio": median / cold[role]})
    load = os.getloadavg()
    result = {"target_s": TARGET_S, "repeats": args.repeats, "loadavg_1_5_15": load, "rows": rows, "runs": runs,
              "cpus": os.cpu_count()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(rows)
    out.with_suffix(".md").write_text(
        "# Recovery: SIGKILL of a worker or its supervisor -> first successful request through the router\n\n"
        f"`python -m bench.recovery --repeats {args.repeats}`; {os.cpu_count()} CPUs, load average "
        f"after the run {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (other work on the machine slows every start).\n"
        "Baseline: the cold start of a fresh process of the same role, measured in the same run.\n\n"
        + text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
