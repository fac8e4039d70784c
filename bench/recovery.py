"""Recovery benchmark: seconds from SIGKILL of a worker (or of its supervisor actor's process) to the first
successful request after it, against the cold start of the same role measured in the same run.

    python -m bench.recovery [--repeats 3] [--out bench/results/recovery]

A copy of the embedded cluster (free loopback ports) brought up with the real CLI; per worker and repeat, SIGKILL
its pid (from `status`; a supervisor's from `<run_dir>/actors/supervisor-<name>.json`: Ray restarts the actor,
which starts the worker again), then a 2-token chat request every 0.2 s: the time to the first 200, and to `status`
READY again. `ratio` = recovery / cold start (a fresh process of the role, spawn to `/health` 200) is what
supervision adds. Target: <= 15 s. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import RESULTS, md_table, process, write
from bench.local_cluster import embedded_topology, run_cli, status_rows
from dsv4_cluster.orchestrator.launch.ports import free_ports

TARGET_S = 15.0
REQUEST = {"model": "dsv4-tiny", "max_tokens": 2, "ignore_eos": True,
           "messages": [{"role": "user", "content": "are you back?"}]}


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
        before = status_rows(home)[name]
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
        row = status_rows(home)[name]
        if row["state"] == "READY" and row["restarts"] == before["restarts"] + 1:
            ready_at = time.monotonic() - killed
            break
        time.sleep(0.2)
    killed_what = name if run_dir is None else f"supervisor of {name}"
    return {"worker": killed_what, "first_success_s": first_ok, "status_ready_by_s": ready_at}


def cold_start(role: str, tmp: Path) -> float:
    """Spawn a fresh worker of `role` on free ports; seconds until its /health answers 200."""
    port, boot = free_ports(2)
    argv = [sys.executable, "-m", f"dsv4_cluster.workers.{role}", "--host", "127.0.0.1", "--port", str(port),
            "--max-total-tokens", "4096", "--context-length", "512",
            *(["--disaggregation-bootstrap-port", str(boot)] if role == "prefill" else [])]
    started = time.monotonic()
    with process(argv, f"http://127.0.0.1:{port}/health", tmp / f"cold-{role}.log", timeout_s=300):
        return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "recovery")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dsv4-recovery-") as tmp:
        home = Path(tmp) / "home"
        topology, ports = embedded_topology(Path(tmp), "dsv4-bench-recovery")
        up = run_cli(home, "up", str(topology), "--timeout", "180", timeout=300)
        if up.returncode != 0:
            print(up.stderr, file=sys.stderr)
            return 1
        try:
            router_url, run_dir = f"http://127.0.0.1:{ports['router']}", topology.parent / "run"
            runs = [recover_once(home, router_url, name, actor) for actor in (None, run_dir)
                    for name in ("decode-0", "prefill-0") for _ in range(args.repeats)]
        finally:
            down = run_cli(home, "down", "--timeout", "10", timeout=300)
            if down.returncode != 0:
                print(down.stderr, file=sys.stderr)
        if failed := [r for r in runs if r["first_success_s"] is None]:
            print(f"no successful request after the kill within the limit: {failed}", file=sys.stderr)
            return 1
        cold = {role: statistics.median(cold_start(role, Path(tmp)) for _ in range(args.repeats))
                for role in ("decode", "prefill")}
    rows = []
    for name, role in (("decode-0", "decode"), ("prefill-0", "prefill"), ("supervisor of decode-0", "decode"),
                       ("supervisor of prefill-0", "prefill")):
        times = [r["first_success_s"] for r in runs if r["worker"] == name]
        ready = [r["status_ready_by_s"] for r in runs if r["worker"] == name and r["status_ready_by_s"] is not None]
        rows.append({"worker": name, "median_s": statistics.median(times), "max_s": max(times), "runs_s": times,
                     "ready_median_s": statistics.median(ready) if ready else float("nan"),
                     "cold_start_s": cold[role], "ratio": statistics.median(times) / cold[role]})
    load = os.getloadavg()
    text = "\n".join(md_table(
        ["killed", "recovery median (s)", "max (s)", "status READY by, median (s)", "cold start (s)",
         "recovery / cold start", "<= 15 s"],
        [[r["worker"], *(f"{r[k]:.2f}" for k in ("median_s", "max_s", "ready_median_s", "cold_start_s", "ratio")),
          "yes" if r["max_s"] <= TARGET_S else "NO"] for r in rows]))
    write(args.out, {"target_s": TARGET_S, "repeats": args.repeats, "loadavg_1_5_15": load, "rows": rows, "runs": runs,
                     "cpus": os.cpu_count()},
          "# Recovery: SIGKILL of a worker or its supervisor -> first successful request through the router\n\n"
          f"`python -m bench.recovery --repeats {args.repeats}`; {os.cpu_count()} CPUs, load average "
          f"after the run {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (other work on the machine slows every start).\n"
          "Baseline: the cold start of a fresh process of the same role, measured in the same run.\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
