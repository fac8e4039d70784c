"""End-to-end load on an embedded cluster: N streamed chat requests at concurrency C through the router.

    python -m bench.load examples/local.yaml --requests 200 --concurrency 16 --out bench/results/load.jsonl
    python -m bench.load --report bench/results/load.jsonl     # the markdown table (load.md)

Brings a copy of the topology up on free ports, measures each worker's CPU over `--idle-s` idle seconds, sends the
load (`orchestrator/load/loadgen.py`, as `dsv4-cluster bench URL` does against a cluster that is already up), brings
it down, and appends the figures, CPU and the load average as one JSON line: for builds measured close together on
one machine (the embedded model is a tiny random-weight model on the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import cpu_seconds, md_table
from bench.local_cluster import LocalCluster, status_rows
from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.orchestrator.load.loadgen import LevelSpec, run_level


def relocated(topology: Path, workdir: Path) -> tuple[Path, str]:
    """A copy of `topology` whose router, worker and bootstrap ports and Ray namespace are free ones."""
    doc = yaml.safe_load(topology.read_text())
    workers = [*doc.get("prefill", []), *doc.get("decode", [])]
    ports = iter(free_ports(2 + 2 * len(workers)))
    doc["router"] = {**doc.get("router", {}), "host": "127.0.0.1", "port": next(ports)}
    for w in workers:
        w["port"] = next(ports)
        if "bootstrap_port" in w:
            w["bootstrap_port"] = next(ports)
    doc["cluster"] = {**doc.get("cluster", {}), "namespace": f"dsv4-load-{next(ports)}", "run_dir": "run"}
    path = workdir / "topology.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, f"http://127.0.0.1:{doc['router']['port']}"


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Fraction of one core each process used over `seconds` of wall time."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: round((cpu_seconds(pid) - before[name]) / seconds, 4) for name, pid in pids.items()}


def report(records: list[dict]) -> str:
    """A markdown table of load records (one JSON line each), each with its ratio to the nearest record
    labelled 'before...' (measured next to it on the same machine); none for a label 'unpaired...'."""
    rows = []
    befores = [i for i, r in enumerate(records) if r["label"].startswith("before")]
    for i, r in enumerate(records):
        paired = befores and not r["label"].startswith("unpaired")
        base = records[min(befores, key=lambda b: abs(b - i))] if paired else None
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base else "-"
        idle = ", ".join(f"{k} {v:.3f}" for k, v in r.get("idle_cpu_core_fraction", {}).items())
        busy = ", ".join(f"{k} {v}" for k, v in r.get("cpu_s_during_load", {}).items())
        rows.append([r["label"], str(r["output_tok_s"]), ratio, str(r["ttft_p50_s"]), str(r["ttft_p99_s"]),
                     str(r["e2e_p50_s"]), str(r["errors"]), idle, busy,
                     f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f}"])
    return "\n".join(md_table(["label", "tok/s", "x before", "TTFT p50 s", "TTFT p99 s", "e2e p50 s", "errors",
                               "idle CPU (cores)", "CPU s under load", "load avg before -> after"], rows)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("topology", nargs="?", type=Path, help="topology to bring up (e.g. examples/local.yaml)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-chars", type=int, default=200)
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measurement before the load")
    p.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before/after)")
    p.add_argument("--out", type=Path, help="append the result as one JSON line to this file")
    p.add_argument("--logs", type=Path, help="copy the cluster's logs here after the run")
    p.add_argument("--report", type=Path, help="print a markdown table of the JSON lines in this file and exit")
    a = p.parse_args(argv)
    if a.report:
        print(report([json.loads(line) for line in a.report.read_text().splitlines() if line.strip()]), end="")
        return 0
    if a.topology is None:
        p.error("give a topology file (`dsv4-cluster bench URL` loads a cluster that is already up)")
    spec = LevelSpec(requests=a.requests, concurrency=a.concurrency, max_tokens=a.max_tokens,
                     prompt_chars=a.prompt_chars)
    with tempfile.TemporaryDirectory(prefix="dsv4-load-") as tmp:
        path, url = relocated(a.topology, Path(tmp))
        try:
            with LocalCluster(Path(tmp) / "home", path, {"router": int(url.rsplit(":", 1)[1])}).running() as cluster:
                pids = {name: w["pid"] for name, w in status_rows(cluster.home).items() if w["pid"]}
                time.sleep(2.0)       # let start-up work (verification, first probes) settle
                idle = idle_cpu(pids, a.idle_s)
                before, client_before = {name: cpu_seconds(pid) for name, pid in pids.items()}, time.process_time()
                result = asyncio.run(run_level(url, spec))
                busy = {name: round(cpu_seconds(pid) - before[name], 1) for name, pid in pids.items()}
                busy["load client"] = round(time.process_time() - client_before, 1)
        finally:
            if a.logs:
                shutil.copytree(path.parent / "run", a.logs, dirs_exist_ok=True)
    record = {"label": a.label, "topology": str(a.topology), **result.to_dict(), "idle_cpu_core_fraction": idle,
              "idle_s": a.idle_s, "cpu_s_during_load": busy}
    print(json.dumps(record, indent=1))
    if a.out:
        with a.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return 0 if result.errors == 0 else 2


if __name__ == "__main__":
    raise SystemExit(main())
