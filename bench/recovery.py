"""Recovery benchmark: seconds from SIGKILL of a worker (or of its supervisor actor's process) to the first
successful request after it, against the cold start of the same role measured in the same run.

    python -m bench.recovery [--repeats 3] [--out bench/results/recovery]

Per worker and repeat on a copy of the embedded cluster: SIGKILL its pid (a supervisor's from
`<run_dir>/actors/supervisor-<name>.json`: Ray restarts the actor, which starts the worker again), then a 2-token
request every 0.25 s: the time to the first 200, and to `status` READY again. `ratio` = recovery / cold start (spawn
to `/health` 200) is what supervision adds. Target: <= 15 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, md_table, process, write
from bench.local_cluster import LocalCluster, status_rows, write_topology
from bench.reliability_faults import recover
from dsv4_cluster.orchestrator.launch.ports import free_ports

TARGET_S = 15.0
KILLED = {"decode-0": "decode", "prefill-0": "prefill"}


def recover_once(cluster: LocalCluster, name: str, supervisor: bool, limit_s: float = 120.0) -> dict:
    """SIGKILL worker `name` (or its supervisor actor's process) and time the recovery."""
    if asyncio.run(recover(cluster.router_url, time.monotonic(), 10)) is None:
        raise RuntimeError("the cluster does not serve before the kill")
    before = status_rows(cluster.home)[name]
    record = cluster.topology.parent / "run" / "actors" / f"supervisor-{name}.json"
    os.kill(json.loads(record.read_text())["pid"] if supervisor else before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    first_ok, ready_at = asyncio.run(recover(cluster.router_url, killed, limit_s)), None
    while ready_at is None and time.monotonic() - killed < limit_s:
        row = status_rows(cluster.home)[name]
        if row["state"] == "READY" and row["restarts"] == before["restarts"] + 1:
            ready_at = time.monotonic() - killed
        time.sleep(0.2)
    return {"worker": f"supervisor of {name}" if supervisor else name, "first_success_s": first_ok,
            "status_ready_by_s": ready_at}


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
        with write_topology(Path(tmp), namespace="dsv4-bench-recovery").running() as cluster:
            runs = [recover_once(cluster, name, supervisor) for supervisor in (False, True) for name in KILLED
                    for _ in range(args.repeats)]
        if failed := [r for r in runs if r["first_success_s"] is None]:
            print(f"no successful request after the kill within the limit: {failed}", file=sys.stderr)
            return 1
        cold = {role: statistics.median(cold_start(role, Path(tmp)) for _ in range(args.repeats))
                for role in KILLED.values()}
    rows = []
    for name, role in [*KILLED.items(), *((f"supervisor of {n}", r) for n, r in KILLED.items())]:
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
