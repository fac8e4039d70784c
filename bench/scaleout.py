"""Scale-out benchmark: N prefill x N decode SGLang-modelled stubs, multi-turn sessions; our `prefix` policy (and its
ablations) vs round robin vs SGLang's gateway's `cache_aware` (sglang-router 0.3.2, smg 1.13.0), one run
(docs/benchmarks.md).

    python -m bench.scaleout [--n 8 64] [--concurrency 64] [--api chat|completions] [--out bench/results]

Per N one process serves the stubs (`stubs.py`); each router in turn is started fresh in front of them, the stubs
reset, and the workload (`scaleout_load.py`) played closed-loop. `floor` (`scaleout_load.py`) is the least a PD
relay can do: its router-added latency is what client, stubs and kernel cost here. A prefix-aware router must first
pass a sanity probe (one session alone, then its last turn twice more, all to one prefill); a row that fails it is
invalid and not compared. Runs in a private network namespace whose loopback ACKs at once (`loopback_ns.py`).
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
from bench.common import RESULTS, cpu_seconds, machine, md_table, pct, process, rss_bytes, write
from bench.router import ANCHORS, anchor_argv, anchor_versions, ours_argv, stop_wait_s
from bench.scaleout_load import Result, Workload, alone, drive
from bench.stubs import Model
from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.router.prefix_policy import PrefixPolicy
from dsv4_cluster.router.prefix_tree import BYTES_PER_NAME

MODEL = "stub"
ROUTERS = ("prefix", "round_robin", "least_load", "prefix_noload", "rust", "smg", "floor")
OURS = {"prefix": ("prefix", {}), "round_robin": ("round_robin", {}), "least_load": ("least_load", {}),
        "prefix_noload": ("prefix", {"balance_abs": 1e9})}
PREFIX_AWARE = ("prefix", "prefix_noload", "rust", "smg")


def router_argv(name: str, port: int, prefills: list[tuple[str, int]], decodes: list[str], tmp: Path) -> list[str]:
    if name in OURS:
        policy, knobs = OURS[name]
        return ours_argv(port, prefills, decodes, tmp, "warning",
                         policy={"prefill": policy, "decode": "round_robin", "prefix": knobs})
    if name == "floor":
        return [sys.executable, "-m", "bench.scaleout_load", "--port", str(port),
                *(x for url, boot in prefills for x in ("--prefill", url, str(boot))),
                *(x for url in decodes for x in ("--decode", url))]
    return anchor_argv(name, port, prefills, decodes, "cache_aware") + ["--decode-policy", "round_robin"]


def sanity(port: int, control: str, w: Workload) -> dict:
    """One session alone, then its last turn again: which prefills took them (the stubs' records, reset after)."""
    results = asyncio.run(alone("127.0.0.1", port, MODEL, w))
    records = httpx.get(control + "/scaleout/records", timeout=30).json()["records"]
    httpx.post(control + "/scaleout/reset", timeout=10).raise_for_status()
    used = [records.get(r.user, {}).get("prefill") for r in results]
    ok = all(r.status == 200 and r.error is None for r in results) and None not in used
    return {"passed": ok and len(set(used)) == 1, "prefills": used}


def cell_row(name: str, n: int, concurrency: int, results: list[Result], stubs: dict, wall_s: float,
             cpu_s: float) -> dict:
    """One router at one N: latency at the client, hit rate at the stubs, router-added latency per request."""
    ok = [r for r in results if r.status == 200 and r.error is None and r.first is not None]
    ok_ids = {id(r) for r in ok}
    records, ttft, added = stubs["records"], [r.ttft_s * 1e3 for r in ok], []
    for r in ok:
        rec = records.get(r.user, {})
        if {"prefill_arrival", "decode_arrival", "first_token"} <= rec.keys():
            added.append((r.ttft_s - rec["first_token"] + min(rec["prefill_arrival"], rec["decode_arrival"])) * 1e3)
    prompt, cached = (sum(p[k] for p in stubs["prefill"]) for k in ("prompt_tokens", "cached_tokens"))
    served = [p["requests"] for p in stubs["prefill"]]
    return {
        "router": name, "n": n, "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "first_errors": sorted({r.error or f"status {r.status}" for r in results if id(r) not in ok_ids})[:3],
        "wall_s": round(wall_s, 3), "requests_per_s": round(len(results) / wall_s, 1),
        "ttft_p50_ms": round(pct(ttft, 50), 3), "ttft_p99_ms": round(pct(ttft, 99), 3),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0, "prompt_tokens": prompt, "cached_tokens": cached,
        "evicted_pages": sum(p.get("evicted_pages", 0) for p in stubs["prefill"]),
        "added_p50_ms": round(pct(added, 50), 3), "added_p99_ms": round(pct(added, 99), 3),
        "cpu_ms_per_request": round(cpu_s * 1e3 / max(1, len(results)), 3),
        "prefill_requests": sum(served), "decode_requests": sum(stubs["decode_requests"].values()),
        "prefills_used": sum(1 for s in served if s), "busiest_prefill_share": round(max(served) / max(1, sum(served)), 3),
        "unrecorded": len(ok) - len(added), "mispaired": stubs["mispaired"], "stub_errors": stubs["errors"],
    }


def run_cell(name: str, n: int, urls: tuple[list, list[str]], port: int, a: argparse.Namespace, tmp: Path) -> dict:
    prefills, decodes = urls
    control, url = prefills[0][0], f"http://127.0.0.1:{port}"
    with process(router_argv(name, port, prefills, decodes, tmp), url + "/health", tmp / f"{name}-{n}.log",
                 timeout_s=180, stop_s=stop_wait_s(name)) as proc:
        if name in OURS:    # a health round: ours reads each prefill's KV capacity (/server_info) there
            time.sleep(1.0)
        httpx.post(control + "/scaleout/reset", timeout=10).raise_for_status()
        check = sanity(port, control, a.workload) if name in PREFIX_AWARE else None
        rss0, cpu0, load0 = rss_bytes(proc.pid), cpu_seconds(proc.pid, session=True), os.getloadavg()[0]
        started = time.monotonic()
        results = asyncio.run(drive("127.0.0.1", port, MODEL, a.workload, a.concurrency))
        wall, cpu = time.monotonic() - started, cpu_seconds(proc.pid, session=True) - cpu0
        rss1, stubs = rss_bytes(proc.pid), httpx.get(control + "/scaleout/records", timeout=30).json()
    row = cell_row(name, n, a.concurrency, results, stubs, wall, cpu)
    row.update(load_average_1m=round(load0, 2), sanity=check, rss_mb_before=round(rss0 / 2**20, 1),
               rss_mb_after=round(rss1 / 2**20, 1))
    if check is not None and not check["passed"]:
        row["invalid"] = f"sanity failed: one session alone went to prefills {check['prefills']}"
    print(f"N={n:3d} {name:12s} {row['requests']:5d} req {row['requests_per_s']:7.1f} req/s  TTFT p50 "
          f"{row['ttft_p50_ms']:7.2f} p99 {row['ttft_p99_ms']:7.2f} ms  hit {row['hit_rate']:.3f}  added p50 "
          f"{row['added_p50_ms']:.3f} ms  cpu {row['cpu_ms_per_request']:.3f} ms/req  errors {row['errors']}", flush=True)
    return row


def targets(rows: list[dict], cache_tokens: int) -> list[str]:
    """Against each anchor whose probe passed: our `prefix` hit rate >= its and TTFT p50 <= its; TTFT p99 <= round
    robin's; at N >= 64 router-added p50 <= 1 ms, and the router's RSS within the start's + the prefix memory's bound
    (docs/router.md)."""
    by, lines, met = {(r["n"], r["router"]): r for r in rows}, [], lambda ok: "met" if ok else "missed"
    for n in sorted({r["n"] for r in rows}):
        p, rr, parts = by.get((n, "prefix")), by.get((n, "round_robin")), []
        if p is None:
            continue
        if p.get("invalid"):
            parts.append(f"our prefix row is invalid ({p['invalid']})")
        for a in (by.get((n, name)) for name in ANCHORS):
            if a is not None and a.get("invalid"):
                parts.append(f"{a['router']} cache_aware not compared ({a['invalid']})")
            elif a is not None:
                parts.append(f"hit rate {p['hit_rate']:.3f} vs {a['router']} {a['hit_rate']:.3f} "
                             f"({met(p['hit_rate'] >= a['hit_rate'])}); TTFT p50 {p['ttft_p50_ms']:.1f} vs "
                             f"{a['ttft_p50_ms']:.1f} ms ({met(p['ttft_p50_ms'] <= a['ttft_p50_ms'])})")
        if rr is not None:
            parts.append(f"hit rate vs round robin {p['hit_rate']:.3f} / {rr['hit_rate']:.3f}; TTFT p99 "
                         f"{p['ttft_p99_ms']:.1f} vs round robin {rr['ttft_p99_ms']:.1f} ms "
                         f"({met(p['ttft_p99_ms'] <= rr['ttft_p99_ms'])})")
        if n >= 64:
            floor, names = by.get((n, "floor")), PrefixPolicy().names_for(cache_tokens)
            parts.append(f"router-added p50 {p['added_p50_ms']:.3f} ms (target <= 1 ms: {met(p['added_p50_ms'] <= 1.0)}"
                         + (f"; the floor relay's {floor['added_p50_ms']:.3f} ms" if floor else "") + ")")
            bound = p["rss_mb_before"] + BYTES_PER_NAME * n * names / 2**20
            parts.append(f"router RSS {p['rss_mb_before']:.0f} -> {p['rss_mb_after']:.0f} MB (bound {bound:.0f} MB: "
                         f"the start's + {BYTES_PER_NAME} B x {n} prefills x {names:,} names; "
                         f"{met(p['rss_mb_after'] <= bound)})")
        lines.append(f"- N = {n}: " + "; ".join(parts))
    return lines


def markdown(result: dict) -> str:
    w, m, api = result["workload"], result["model"], result["workload"].get("api", "chat")
    sanity_cell = lambda c: "-" if c is None else "passed" if c["passed"] else f"FAILED (prefills {c['prefills']})"  # noqa: E731
    rows = [[r["n"], r["router"] + (" (invalid)" if r.get("invalid") else ""), sanity_cell(r.get("sanity")),
             r["requests"], f"{r['requests_per_s']:,.1f}", f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f}",
             f"{r['hit_rate']:.3f}", f"{r['added_p50_ms']:.2f} / {r['added_p99_ms']:.2f}",
             f"{r['cpu_ms_per_request']:.2f}", f"{r['prefills_used']} ({r['busiest_prefill_share']:.2f})",
             f"{r.get('evicted_pages', 0):,}", f"{r['rss_mb_before']:.0f} / {r['rss_mb_after']:.0f}", r["errors"],
             f"{r['load_average_1m']:.1f}"] for r in result["rows"]]
    return "\n".join([
        "# Scale-out benchmark" + ("" if api == "chat" else " (completions)"), "", f"`python -m bench.scaleout --api {api}`",
        "", f"N prefill x N decode SGLang-modeled stubs (one process); {w['sessions']} sessions x {w['turns']} turns "
        f"({'chat' if api == 'chat' else '/v1/completions with the whole history as the prompt'}), a "
        f"{w['system_chars']}-char system prompt shared by all, {w['first_chars']} chars of first user message, "
        f"{w['turn_chars']} more per turn, {w['max_tokens']} tokens out; concurrency {result['concurrency']} (closed "
        f"loop). Prefill {m['base_ms']:g} ms + {m['per_token_us']:g} us per uncached token, FIFO; prefix cache "
        f"{m['cache_tokens']:,} tokens per prefill (16-token pages of the stubs' own tokens, leaf-first LRU; reported "
        f"as max_total_num_tokens); decode {m['token_ms']:g} ms per token. Routers: ours with `policy.prefill` prefix, "
        "round_robin, least_load (no prefix memory), prefix_noload (no load term), decode round_robin; SGLang's "
        "gateway `--prefill-policy cache_aware --decode-policy round_robin`: rust = "
        f"{result['anchors']['rust']}, smg = {result['anchors']['smg']} (as each says itself). Sanity: one session "
        "alone, then its last turn twice more, must all reach one prefill; a row that fails it is invalid and not "
        "compared.", "",
        *md_table(["N", "router", "sanity", "requests", "req/s", "TTFT p50 / p99 ms", "hit rate",
                   "router-added p50 / p99 ms", "router CPU ms/req", "prefills used (busiest share)", "pages evicted",
                   "RSS MB before / after", "errors", "load 1m"], rows),
        "", "The targets (same run):", "", *targets(result["rows"], m["cache_tokens"]), "",
        f"{result['cpus']} CPUs shared with other work; 1-min load average {result['load_average_before'][0]:.1f} "
        f"before, {result['load_average_after'][0]:.1f} after; loopback: {result['loopback']}. Router-added: client "
        "TTFT minus the stubs' part (first leg's arrival to the decode's first token). Hit rate: cached / prompt "
        "tokens over all prefills, as the stubs count them. Router CPU includes its health checks.", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[8, 64], help="prefill (and decode) workers")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    p.add_argument("--sessions", type=int, default=Workload.sessions)
    p.add_argument("--turns", type=int, default=Workload.turns)
    p.add_argument("--think-ms", type=float, default=Workload.think_ms, help="a user's pause between turns, "
                   "uniform from 0 to this")
    p.add_argument("--api", choices=["chat", "completions"], default=Workload.api,
                   help="chat messages, or /v1/completions with the whole history as the prompt")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plain-loopback", action="store_true",
                   help="run on the machine's loopback (delayed ACKs stall the Rust router ~40 ms a request)")
    a = p.parse_args(argv)
    if any(n < 1 or n > 128 for n in a.n):
        p.error("--n takes worker counts from 1 to 128")
    if not a.plain_loopback and not loopback_ns.inside():
        return loopback_ns.reexec_in_quickack_netns("bench.scaleout", sys.argv[1:] if argv is None else argv)
    a.workload = Workload(sessions=a.sessions, turns=a.turns, think_ms=a.think_ms, api=a.api)
    model, before, rows = Model(), machine(), []
    with tempfile.TemporaryDirectory(prefix="scaleout-bench-") as tmp_name:
        for n in a.n:
            ports = free_ports(3 * n + 1)
            prefills = [(f"http://127.0.0.1:{port}", boot) for port, boot in zip(ports[:n], ports[n:2 * n])]
            decodes = [f"http://127.0.0.1:{port}" for port in ports[2 * n:3 * n]]
            farm = {"prefill": list(zip(ports[:n], ports[n:2 * n])), "decode": ports[2 * n:3 * n], "model": asdict(model)}
            with process([sys.executable, "-m", "bench.stubs", "--farm", json.dumps(farm)], decodes[-1] + "/health",
                         Path(tmp_name) / f"stubs-{n}.log"):
                rows += [run_cell(name, n, (prefills, decodes), ports[-1], a, Path(tmp_name)) for name in a.routers]
    after = machine()
    result = {"loopback": "plain" if a.plain_loopback else "private netns, quickack", "cpus": after["cpus"],
              "anchors": anchor_versions(),
              "load_average_before": before["loadavg"], "load_average_after": after["loadavg"],
              "concurrency": a.concurrency, "workload": asdict(a.workload), "model": asdict(model), "rows": rows}
    text = markdown(result)
    write(a.out / ("scaleout" if a.api == "chat" else "scaleout_completions"), result, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
