"""Scale-out benchmark: N prefill x N decode SGLang-modeled stubs, multi-turn chat, our `prefix` vs our `round_robin`
vs SGLang's Rust router `cache_aware`, on the same stubs and load, one run.

    python -m bench.scaleout [--n 1 8 64] [--concurrency 64] [--out bench/results]

For each N: one stub process serves N prefills and N decodes (`scaleout_stubs.py`: prefill time linear in uncached
tokens on a FIFO, a per-prefill prefix cache of fixed size with LRU, decode a fixed time per token, the PD
protocol's bootstrap fields). Then each router in turn is started fresh in front of them, the stubs' caches and
records are reset, and the workload (`scaleout_load.py`: sessions resending a growing history over a shared system
prompt) is played closed-loop at `--concurrency`. Per router and N:

- TTFT p50 / p99: at the client, request written to first content event;
- cache hit rate: cached / prompt tokens over every prefill, as the stubs count them;
- router-added latency: the client's TTFT minus the stubs' own share of it (first leg arriving at a stub to the
  decode writing the first token), per request: forwarding the request and relaying the first token;
- router CPU per request: user + system time of the router's processes over the run / requests;
- requests/s, errors, and checks that every request reached a prefill and a decode of one pair (`mispaired`).

`floor` (`scaleout_floor.py`) is not a router but a yardstick: the least a PD relay can do (round robin, bootstrap
fields, bytes relayed); its router-added latency is what the client, stubs and kernel cost on this machine.

Every process listens on 127.0.0.1 only, inside a private network namespace whose loopback ACKs at once
(`loopback_ns.py`); the Rust router runs with `--log-level warn` (no line per request, as ours). Writes
`scaleout.json` and `scaleout.md` to `--out`, with the load average, because the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from bench import loopback_ns
from bench.router import process
from bench.scaleout_load import Workload, drive
from bench.scaleout_stubs import Model
from bench.scaleout_report import cell_row, markdown
from dsv4_cluster.orchestrator.launch.ports import free_ports

MODEL = "stub"
ROUTERS = ("prefix", "round_robin", "cache_aware", "floor")


def cpu_seconds(session_id: int) -> float:
    """User + system CPU seconds of every live process in the session `session_id` (the router and its children)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session_id:   # field 6 of stat: the session id
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def router_argv(name: str, port: int, prefills: list[str], boots: list[int], decodes: list[str], tmp: Path) -> list[str]:
    if name in ("prefix", "round_robin"):
        settings = {"host": "127.0.0.1", "port": port, "model_name": MODEL, "prefill_policy": name,
                    "decode_policy": "round_robin",
                    "prefill": [{"name": f"prefill-{i}", "url": u, "bootstrap_host": "127.0.0.1", "bootstrap_port": b}
                                for i, (u, b) in enumerate(zip(prefills, boots))],
                    "decode": [{"name": f"decode-{i}", "url": u} for i, u in enumerate(decodes)]}
        (tmp / "router.json").write_text(json.dumps(settings))
        return [sys.executable, "-m", "dsv4_cluster.router", "--config", str(tmp / "router.json"),
                "--log-level", "warning"]
    if name == "floor":
        argv = [sys.executable, "-m", "bench.scaleout_floor", "--port", str(port)]
        for url, boot in zip(prefills, boots):
            argv += ["--prefill", url, str(boot)]
        return argv + [x for url in decodes for x in ("--decode", url)]
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
            "--port", str(port), "--prefill-policy", "cache_aware", "--decode-policy", "round_robin",
            "--log-level", "warn"]
    for url, boot in zip(prefills, boots):
        argv += ["--prefill", url, str(boot)]
    for url in decodes:
        argv += ["--decode", url]
    return argv


def run_cell(name: str, n: int, urls: tuple[list[str], list[int], list[str]], port: int, args: argparse.Namespace,
             tmp: Path) -> dict:
    prefills, boots, decodes = urls
    control = prefills[0]
    url = f"http://127.0.0.1:{port}"
    argv = router_argv(name, port, prefills, boots, decodes, tmp)
    log = tmp / f"{name}-{n}.log"
    with process(argv, url + "/health", log, timeout_s=180) as proc:
        httpx.post(control + "/scaleout/reset", timeout=10).raise_for_status()
        cpu0, load0 = cpu_seconds(proc.pid), os.getloadavg()[0]
        started = time.monotonic()
        results = asyncio.run(drive("127.0.0.1", port, MODEL, args.workload, args.concurrency))
        wall = time.monotonic() - started
        cpu = cpu_seconds(proc.pid) - cpu0
        stubs = httpx.get(control + "/scaleout/records", timeout=30).json()
    row = cell_row(name, n, args.concurrency, results, stubs, wall, cpu)
    row["load_average_1m"] = round(load0, 2)
    print(f"N={n:3d} {name:12s} {row['requests']:5d} req {row['requests_per_s']:7.1f} req/s  TTFT p50 "
          f"{row['ttft_p50_ms']:7.2f} p99 {row['ttft_p99_ms']:7.2f} ms  hit {row['hit_rate']:.3f}  added p50 "
          f"{row['added_p50_ms']:.3f} ms  cpu {row['cpu_ms_per_request']:.3f} ms/req  errors {row['errors']}",
          flush=True)
    return row


def run_n(n: int, args: argparse.Namespace, tmp: Path) -> list[dict]:
    ports = free_ports(3 * n + 1)
    prefill_ports, boots, decode_ports, router_port = ports[:n], ports[n:2 * n], ports[2 * n:3 * n], ports[-1]
    prefills = [f"http://127.0.0.1:{p}" for p in prefill_ports]
    decodes = [f"http://127.0.0.1:{p}" for p in decode_ports]
    model = args.model
    stub = [sys.executable, "-m", "bench.scaleout_stubs", "--prefill-ports", *map(str, prefill_ports),
            "--bootstrap-ports", *map(str, boots), "--decode-ports", *map(str, decode_ports)]
    stub += [x for k, v in asdict(model).items() for x in ("--" + k.replace("_", "-"), str(v))]
    rows = []
    with process(stub, decodes[-1] + "/health", tmp / f"stubs-{n}.log"):
        for name in args.routers:
            rows.append(run_cell(name, n, (prefills, boots, decodes), router_port, args, tmp))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 8, 64], help="prefill (and decode) workers")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--sessions", type=int, default=Workload.sessions)
    parser.add_argument("--turns", type=int, default=Workload.turns)
    parser.add_argument("--think-ms", type=float, default=Workload.think_ms, help="a user's pause between turns, "
                        "uniform from 0 to this")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--plain-loopback", action="store_true",
                        help="run on the machine's loopback (delayed ACKs stall the Rust router ~40 ms a request)")
    args = parser.parse_args(argv)
    if any(n < 1 or n > 128 for n in args.n):
        parser.error("--n takes worker counts from 1 to 128")
    if not args.plain_loopback and not loopback_ns.inside():
        return loopback_ns.reexec_in_quickack_netns("bench.scaleout",
                                                     sys.argv[1:] if argv is None else argv)
    args.workload = Workload(sessions=args.sessions, turns=args.turns, think_ms=args.think_ms)
    args.model = Model()
    load_before = os.getloadavg()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="scaleout-bench-") as tmp_name:
        for n in args.n:
            rows += run_n(n, args, Path(tmp_name))
    load_after = os.getloadavg()
    result = {"loopback": "plain" if args.plain_loopback else "private netns, quickack", "cpus": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": load_after,
              "concurrency": args.concurrency, "workload": asdict(args.workload), "model": asdict(args.model),
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaleout.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / "scaleout.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
