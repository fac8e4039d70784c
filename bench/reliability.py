"""Reliability bench: faults under in-flight requests, bad input, security checks and a load soak, on a real
embedded cluster (Ray, supervisors, NIXL, router; loopback only), in one command.

    python -m bench.reliability [--only faults,input,security,soak] [--soak-requests 2000] \
        [--fuzz-cases 500] [--out bench/results/reliability]

Brings up one cluster (1 prefill + 1 decode with `--test-hooks`, free ports) with the real CLI, runs the
parts, brings it down and checks that no process of it is left (/proc). Parts:
  faults    `reliability_faults.py`: kill -9 decode mid-stream, kill -9 prefill during the KV transfer,
            kill -9 router, SIGSTOP decode 20 s then SIGCONT, a decode engine that stalls while its HTTP
            server answers. Per fault: in flight, completed, errored explicitly, held (then completed), reset, hung, lost,
            recovery time, requests after recovery, KV back to baseline, orphans.
  input     `reliability_input.py`: schemathesis against the router's and a worker's OpenAPI schema,
            413 past the body limit, malformed bodies, slowloris.
  security  `reliability_security.py`: bound addresses from /proc, keys and tokens never logged, no prompt
            text in metrics or logs.
  soak      `reliability_soak.py`: N chat requests at concurrency 32, mixed, with clients that hang up.
Prints a table, writes <out>.json and <out>.md. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from . import proc_probe
from .local_cluster import write_topology
from .reliability_faults import Cluster, all_faults
from .reliability_report import render

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("faults", "input", "security", "soak")
HOOKS = ", extra_args: [--test-hooks]"


def run(parts: set[str], args: argparse.Namespace, workdir: Path) -> dict:
    local = write_topology(workdir, context_length=512, extra_decode=HOOKS, extra_prefill=HOOKS)
    out: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_before": list(os.getloadavg())}, "parts": sorted(parts)}
    started = time.monotonic()
    with local.running() as c:
        cluster = Cluster(c.cli, c.router_url, c.ports, c.home)
        if "security" in parts:
            from .reliability_security import security_checks
            out["security"] = security_checks(cluster)
        if "input" in parts:
            from .reliability_input import input_checks
            out["input"] = input_checks(cluster, args.fuzz_cases)
        if "faults" in parts:
            only = set(args.fault) if args.fault else None
            out["faults"] = [r.to_dict() for r in asyncio.run(all_faults(cluster, only=only))]
        if "soak" in parts:
            from .reliability_soak import soak
            out["soak"] = asyncio.run(soak(cluster, args.soak_requests, args.concurrency))
    left = proc_probe.orphans(set(local.ports.values()), set())
    left += [f"port {p}: worker pid(s) {pids} still running after down"
             for p, pids in proc_probe.worker_processes(set(local.ports.values())).items() if pids]
    out["after_down"] = {"leftover_processes": left}
    out["machine"]["loadavg_after"] = list(os.getloadavg())
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out


def passed(out: dict) -> bool:
    ok = not out["after_down"]["leftover_processes"]
    ok &= all(f["ok"] for f in out.get("faults", []))
    ok &= out.get("soak", {}).get("ok", True)
    ok &= out.get("input", {}).get("ok", True)
    ok &= out.get("security", {}).get("ok", True)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--fault", action="append", help="run only the faults whose name contains this (repeatable)")
    p.add_argument("--soak-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--fuzz-cases", type=int, default=500, help="schemathesis cases per API (router, worker)")
    p.add_argument("--out", type=Path, default=RESULTS / "reliability", help="writes OUT.json and OUT.md")
    a = p.parse_args(argv)
    parts = {x.strip() for x in a.only.split(",") if x.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        p.error(f"--only: unknown part(s) {sorted(unknown)}; choose from {PARTS}")
    with tempfile.TemporaryDirectory(prefix="dsv4-reliability-") as tmp:
        out = run(parts, a, Path(tmp))
    out["command"] = "python -m bench.reliability " + " ".join(argv if argv is not None else sys.argv[1:])
    out["passed"] = passed(out)
    text = render(out)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(text)
    print(text)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
