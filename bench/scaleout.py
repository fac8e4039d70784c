"""Scale-out benchmark: N prefill x N decode SGLang-modeled stubs, multi-turn sessions, our `prefix` policy (and its
ablations) vs round robin vs SGLang's gateway's `cache_aware` (sglang-router 0.3.2 and smg 1.13.0), on the same stubs
and load, one run.

    python -m bench.scaleout [--n 8 64] [--concurrency 64] [--api chat|completions] [--out bench/results]

For each N: one stub process serves N prefills and N decodes (`scaleout_stubs.py`: prefill time linear in uncached
tokens on a FIFO, a per-prefill prefix cache of token pages small enough to evict, decode a fixed time per token,
the PD protocol's bootstrap fields). Then each router in turn is started fresh in front of them, the stubs' caches
and records are reset, and the workload (`scaleout_load.py`: sessions resending a growing history over a shared
system prompt, as chat or as `/v1/completions` with the whole history) is played closed-loop at `--concurrency`.
Routers: ours with `prefill_policy` `prefix`, `round_robin`, `least_load` (no prefix memory) and `prefix_noload`
(`prefix` with no load term), SGLang's gateways with `--prefill-policy cache_aware --decode-policy round_robin`
(`rust`: sglang-router 0.3.2, `smg`: smg 1.13.0). Per router and N:

- sanity (prefix-aware routers): before the workload one session is played alone, then its last turn twice more;
  a router that routes by prefix sends all of them to one prefill. A row whose probe fails is marked invalid and
  its comparisons are not reported;
- TTFT p50 / p99: at the client, request written to first content event;
- cache hit rate: cached / prompt tokens over every prefill, as the stubs count them;
- router-added latency: the client's TTFT minus the stubs' own share of it (first leg arriving at a stub to the
  decode writing the first token), per request: forwarding the request and relaying the first token;
- router CPU per request: user + system time of the router's processes over the run / requests; the router
  process's RSS before and after the workload;
- requests/s, errors, and checks that every request reached a prefill and a decode of one pair (`mispaired`).

`floor` (`scaleout_floor.py`) is not a router but a yardstick: the least a PD relay can do (round robin, bootstrap
fields, bytes relayed); its router-added latency is what the client, stubs and kernel cost on this machine.

Every process listens on 127.0.0.1 only, inside a private network namespace whose loopback ACKs at once
(`loopback_ns.py`); the gateways run with `--log-level warn` (no line per request, as ours). Writes
`scaleout.json` / `.md` (chat) or `scaleout_completions.json` / `.md` to `--out`, with the load average, because
the machine is shared.
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
from bench.router import anchor_argv, process
from bench.scaleout_load import Workload, alone, drive
from bench.scaleout_stubs import Model
from bench.scaleout_report import cell_row, markdown
from dsv4_cluster.orchestrator.launch.ports import free_ports

MODEL = "stub"
ROUTERS = ("prefix", "round_robin", "least_load", "prefix_noload", "rust", "smg", "floor")
OURS = {"prefix": ("prefix", {}), "round_robin": ("round_robin", {}), "least_load": ("least_load", {}),
        "prefix_noload": ("prefix", {"balance_abs": 1e9})}      # ablations: no prefix memory; no load term
PREFIX_AWARE = ("prefix", "prefix_noload", "rust", "smg")       # the rows a sanity probe must pass


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


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def router_argv(name: str, port: int, prefills: list[str], boots: list[int], decodes: list[str], tmp: Path) -> list[str]:
    if name in OURS:
        policy, knobs = OURS[name]
        settings = {"host": "127.0.0.1", "port": port, "model_name": MODEL, "prefill_policy": policy,
                    "decode_policy": "round_robin", "prefix": knobs,
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
    return anchor_argv(name, port, list(zip(prefills, boots)), decodes, "cache_aware") + ["--decode-policy",
                                                                                          "round_robin"]


def sanity(port: int, control: str, args: argparse.Namespace) -> dict:
    """One session alone, then its last turn again (scaleout_load.alone): which prefills took them, from the stubs'
    records. Passes when one prefill took them all; the caches are reset after it."""
    results = asyncio.run(alone("127.0.0.1", port, MODEL, args.workload))
    records = httpx.get(control + "/scaleout/records", timeout=30).json()["records"]
    httpx.post(control + "/scaleout/reset", timeout=10).raise_for_status()
    used = [records.get(r.user, {}).get("prefill") for r in results]
    ok = all(r.status == 200 and r.error is None for r in results) and None not in used
    return {"passed": ok and len(set(used)) == 1, "prefills": used}


def run_cell(name: str, n: int, urls: tuple[list[str], list[int], list[str]], port: int, args: argparse.Namespace,
             tmp: Path) -> dict:
    prefills, boots, decodes = urls
    control = prefills[0]
    url = f"http://127.0.0.1:{port}"
    argv = router_argv(name, port, prefills, boots, decodes, tmp)
    log = tmp / f"{name}-{n}.log"
    with process(argv, url + "/health", log, timeout_s=180) as proc:
        time.sleep(1.0)     # a health round: ours reads each prefill's KV capacity (/server_info) there
        httpx.post(control + "/scaleout/reset", timeout=10).raise_for_status()
        check = sanity(port, control, args) if name in PREFIX_AWARE else None
        rss0 = rss_mb(proc.pid)
        cpu0, load0 = cpu_seconds(proc.pid), os.getloadavg()[0]
        started = time.monotonic()
        results = asyncio.run(drive("127.0.0.1", port, MODEL, args.workload, args.concurrency))
        wall = time.monotonic() - started
        cpu = cpu_seconds(proc.pid) - cpu0
        rss1 = rss_mb(proc.pid)
        stubs = httpx.get(control + "/scaleout/records", timeout=30).json()
    row = cell_row(name, n, args.concurrency, results, stubs, wall, cpu)
    row.update(load_average_1m=round(load0, 2), sanity=check, rss_mb_before=round(rss0, 1), rss_mb_after=round(rss1, 1))
    if check is not None and not check["passed"]:
        row["invalid"] = f"sanity failed: one session alone went to prefills {check['prefills']}"
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
    parser.add_argument("--n", type=int, nargs="+", default=[8, 64], help="prefill (and decode) workers")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--sessions", type=int, default=Workload.sessions)
    parser.add_argument("--turns", type=int, default=Workload.turns)
    parser.add_argument("--think-ms", type=float, default=Workload.think_ms, help="a user's pause between turns, "
                        "uniform from 0 to this")
    parser.add_argument("--api", choices=["chat", "completions"], default=Workload.api,
                        help="chat messages, or /v1/completions with the whole history as the prompt")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--plain-loopback", action="store_true",
                        help="run on the machine's loopback (delayed ACKs stall the Rust router ~40 ms a request)")
    args = parser.parse_args(argv)
    if any(n < 1 or n > 128 for n in args.n):
        parser.error("--n takes worker counts from 1 to 128")
    if not args.plain_loopback and not loopback_ns.inside():
        return loopback_ns.reexec_in_quickack_netns("bench.scaleout",
                                                     sys.argv[1:] if argv is None else argv)
    args.workload = Workload(sessions=args.sessions, turns=args.turns, think_ms=args.think_ms, api=args.api)
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
    stem = "scaleout" if args.api == "chat" else "scaleout_completions"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
