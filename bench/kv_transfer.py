"""KV transfer per request size through the engine, against raw NIXL and a device copy, measured in one run.

    python -m bench.kv_transfer --out bench/results/kv_transfer \
        [--prefill-device cuda:0 --decode-device cuda:1] [--pages fresh,churned,cache] [--max-tokens 16384]

Two processes (`kv_transfer_sides.py`), each with the engine's own KV pool for the preset in the state `--pages`
asks for (a list runs each in turn) and the engine's own `NixlTransfer`, one agent per side as in a worker. Per
request size, interleaved over `--repeats` trials: the engine's `write_pages`, one raw NIXL WRITE of one region of
the same bytes, and a device copy; throughput is bytes / p50 latency, every size checked byte for byte. Which UCX
transport carried the bytes is read from UCX's own log (`ucx_proto.py`). With `--nixl-telemetry` (or
NIXL_TELEMETRY_ENABLE=y) NIXL's own telemetry of each engine and raw WRITE is kept (post duration, post to done,
descriptors after merging) and tabled beside the times: what NIXL spent against what the host spent around it.
Writes OUT.json (one state: its report; several: reports by state) and OUT.md (a table per state).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.orchestrator.processes import log_tail
from dsv4_cluster.workers.engine.presets import PRESETS
from . import ucx_proto
from .common import md_table, pct, process, write
from .kv_transfer_sides import PAGE_STATES, PREFILL_AGENT, RAW_PREFILL_AGENT, build_pool

SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# engine >= 80% of raw NIXL for requests >= 8K tokens, >= 50% at 1K
TARGET_RATIO, TARGET_MIN_TOKENS, SMALL_TARGET_RATIO, SMALL_TOKENS = 0.8, 8192, 0.5, 1024
METHODS = ("engine", "raw", "copy")


class BenchError(RuntimeError):
    """A side failed or did not finish in time; the message carries its log's tail."""


def pool_pages(a: argparse.Namespace, pages: str) -> int:
    """Each side's pool: twice the largest request fresh; churned (or cache) room for the largest request in what
    `--occupancy` leaves free, and half as much again (the churn leaves its free pages in a few runs)."""
    largest = max(-(-t // a.page_size) for t in a.sizes)
    if a.pool_pages:
        return a.pool_pages
    if pages in ("churned", "cache"):
        return int(largest / (1 - a.occupancy) * 1.5) + 1
    return 2 * largest


def run_sides(a: argparse.Namespace, pages: str, workdir: Path) -> dict:
    """Start the decode and the prefill side with pools in state `pages`, wait for the prefill's result; neither
    outlives this call."""
    side = {k: getattr(a, k) for k in ("sizes", "preset", "n_layers", "page_size", "repeats", "warmup", "ucx_tls",
                                       "churn_cycles", "occupancy", "order")}
    side.update(port=free_ports(1)[0], pool_pages=pool_pages(a, pages), pages=pages, seed=0, peer_device=a.decode_device)
    mod = [sys.executable, "-m", "bench.kv_transfer_sides"]
    cmds = {"decode": [*mod, json.dumps({**side, "role": "decode", "device": a.decode_device})],
            "prefill": [*mod, json.dumps({**side, "role": "prefill", "device": a.prefill_device,
                                          "result": str(workdir / "result.json")})]}
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info", "PYTHONUNBUFFERED": "1",
           **({"NIXL_TELEMETRY_ENABLE": "y"} if a.nixl_telemetry else {})}
    with contextlib.ExitStack() as stack:
        procs = {name: stack.enter_context(process(cmd, None, workdir / f"{name}.log", env=env))
                 for name, cmd in cmds.items()}
        deadline = time.monotonic() + a.timeout_s
        while (rc := procs["prefill"].poll()) is None:
            if procs["decode"].poll() not in (None, 0):      # the prefill would wait for it until its timeout
                raise BenchError(f"the decode side exited with {procs['decode'].returncode}:\n"
                                 + log_tail(str(workdir / "decode.log")))
            if time.monotonic() > deadline:
                raise BenchError(f"the prefill side did not finish within {a.timeout_s:.0f}s (--timeout-s):\n"
                                 + log_tail(str(workdir / "prefill.log")))
            time.sleep(0.2)
        if rc != 0:
            raise BenchError(f"the prefill side exited with {rc}:\n{log_tail(str(workdir / 'prefill.log'))}\n"
                             f"decode side:\n{log_tail(str(workdir / 'decode.log'))}")
        procs["decode"].wait(30)       # it exits on the prefill's stop
        return json.loads((workdir / "result.json").read_text())


def stats(times: list[float], nbytes: int) -> dict:
    p50 = pct(times, 50)
    return {"p50_ms": round(p50 * 1e3, 4), "p99_ms": round(pct(times, 99) * 1e3, 4),
            "mean_ms": round(sum(times) / len(times) * 1e3, 4), "gb_s": round(nbytes / p50 / 1e9, 3), "n": len(times)}


def telemetry(t: dict, method: str) -> dict | None:
    """NIXL's telemetry of `method`'s timed WRITEs (kv_transfer_sides.TELEMETRY_KEYS), None where none was kept."""
    post = [x for x in t.get(f"{method}_post_us", []) if x is not None]
    if not post:
        return None
    xfer = [x for x in t[f"{method}_xfer_us"] if x is not None]
    return {"post_us_p50": pct(post, 50), "post_us_p99": pct(post, 99), "xfer_us_p50": pct(xfer, 50),
            "xfer_us_p99": pct(xfer, 99), "descs": sorted({x for x in t[f"{method}_descs"] if x is not None}),
            "n": len(post)}


def summarize(raw: dict) -> list[dict]:
    rows = []
    for size in raw["sizes"]:
        t, n = size["times_s"], size["bytes"]
        row = {k: size[k] for k in ("tokens", "pages", "bytes", "descriptors", "page_runs", "run_lengths", "checks")}
        row.update({m: stats(t[m], n) for m in METHODS})
        row.update({f"{m}_done_only": stats(t[f"{m}_done"], n) for m in ("engine", "raw")})  # the prefill's view alone
        row.update({f"{m}_nixl_telemetry": tm for m in ("engine", "raw") if (tm := telemetry(t, m))})
        row["ratios"] = {"engine_vs_raw": round(row["engine"]["gb_s"] / row["raw"]["gb_s"], 3),
                         "engine_vs_copy": round(row["engine"]["gb_s"] / row["copy"]["gb_s"], 3)}
        c = row["checks"]
        c["engine_bytes_match"] = c["engine_written_bytes"] == n
        c["raw_bytes_match"] = c["raw_written_bytes"] == n
        c["ok"] = all(c[k] for k in ("engine_bytes_match", "engine_contents_equal", "raw_bytes_match",
                                     "raw_contents_equal", "copy_contents_equal"))
        rows.append(row)
    return rows


def table(report: dict) -> str:
    cfg, pool, ucx = report["config"], report["pool"], report["ucx"]
    lay = pool["layout"]
    head = (f"KV transfer, prefill {cfg['prefill_device']} -> decode {cfg['decode_device']} "
            f"({' -> '.join(pool['device_names'])}; load average at start {cfg['host_load_avg_at_start'][0]}): "
            f"preset {cfg['preset']} "
            f"({lay['n_layers']} layers, {pool['buffers']} buffers in {pool['regions']} NIXL regions, page "
            f"{lay['page_size']} tokens, {lay['dtype']}: "
            f"{pool['page_bytes']} B per page, {min(pool['buffer_page_bytes'])}-{max(pool['buffer_page_bytes'])} B "
            "per buffer), "
            f"pages: {cfg['pages']}, {cfg.get('order', 'prefill-first')} (which side allocated first), "
            f"{cfg['repeats']} repeats (+{cfg['warmup']} warmup), GB/s = bytes / p50 latency.\n\n"
            f"UCX transports of the WRITEs (UCX_PROTO_INFO): engine {_transports(ucx['engine'])}; "
            f"raw NIXL {_transports(ucx['raw'])}.\n\n")
    state = pool.get("state", {})
    if cfg["pages"] != "fresh":
        head += "Pools before the timed requests: " + "; ".join(
            f"{side} {st['held_pages']} pages held ({st.get('occupancy', '?')} of the pool), {st['free_pages']} free "
            f"in {st['free_runs']} runs (longest {st['longest_free_run']})" for side, st in state.items()) + ".\n\n"
    rows = md_table(["tokens", "MB", "descs (runs)", "page runs src / dst (max len)", "engine GB/s",
                     "engine p50 / p99 ms", "raw GB/s", "raw p50 / p99 ms", "copy GB/s", "engine / raw", "engine / copy",
                     "checks"],
                    [[r["tokens"], f"{r['bytes'] / 1e6:.1f}", r["descriptors"]["engine"],
                      f"{len(rl['src'])} / {len(rl['dst'])} ({max(rl['src'])} / {max(rl['dst'])})", str(e["gb_s"]),
                      f"{e['p50_ms']} / {e['p99_ms']}", str(w["gb_s"]), f"{w['p50_ms']} / {w['p99_ms']}",
                      str(r["copy"]["gb_s"]), str(r["ratios"]["engine_vs_raw"]), str(r["ratios"]["engine_vs_copy"]),
                      "ok" if r["checks"]["ok"] else "FAILED"]
                     for r in report["sizes"] for e, w, rl in [(r["engine"], r["raw"], r["run_lengths"])]])
    tele = [r for r in report["sizes"] if "engine_nixl_telemetry" in r and "raw_nixl_telemetry" in r]
    if tele:    # NIXL's own clock (post: in the post call; xfer: to DONE as a status check saw it), beside the p50s
        rows += ["", "NIXL telemetry (NIXL_TELEMETRY_ENABLE=y), p50 us:", ""] + md_table(
            ["tokens", "engine post / xfer", "raw post / xfer", "descs after merging engine / raw",
             "engine - raw: WRITE p50", "engine - raw: NIXL xfer"],
            [[r["tokens"], f"{e['post_us_p50']} / {e['xfer_us_p50']}", f"{w['post_us_p50']} / {w['xfer_us_p50']}",
              f"{e['descs']} / {w['descs']}", f"{(r['engine']['p50_ms'] - r['raw']['p50_ms']) * 1e3:.1f}",
              str(e["xfer_us_p50"] - w["xfer_us_p50"])]
             for r in tele for e, w in [(r["engine_nixl_telemetry"], r["raw_nixl_telemetry"])]])
    tgt = report["target"]
    verdict = {None: "n/a (size not measured)", True: "met", False: "not met"}
    return (head + "\n".join(rows) + f"\n\nTargets: engine >= {TARGET_RATIO} x raw NIXL for >= {TARGET_MIN_TOKENS} "
            f"tokens: {verdict[tgt['met']]} (min {tgt['min_engine_vs_raw']}); >= {SMALL_TARGET_RATIO} x at "
            f"{SMALL_TOKENS}: {verdict[tgt['small_met']]} ({tgt['small_engine_vs_raw']}).\n")


def _transports(agent: dict) -> str:
    if agent["put_transports"]:
        return ", ".join(agent["put_transports"])
    if agent.get("carried_by"):
        return ", ".join(agent["carried_by"]) + " (the endpoint's device lane; UCX prints no GPU -> GPU put table)"
    return f"no put table logged (endpoint lanes: {'; '.join(agent['peer_lanes']) or 'none logged'})"


def build_report(a: argparse.Namespace, pages: str, raw: dict, logs: list[Path], load: tuple[float, ...]) -> dict:
    rows = summarize(raw)
    big = [r["ratios"]["engine_vs_raw"] for r in rows if r["tokens"] >= TARGET_MIN_TOKENS]
    small = next((r["ratios"]["engine_vs_raw"] for r in rows if r["tokens"] == SMALL_TOKENS), None)
    on_gpus = a.prefill_device.startswith("cuda") and a.decode_device.startswith("cuda")
    agents = {"engine": PREFILL_AGENT, "raw": RAW_PREFILL_AGENT}
    ucx = ucx_proto.summarize(logs, list(agents.values()), "cuda" if on_gpus else "host")
    return {"config": {"prefill_device": a.prefill_device, "decode_device": a.decode_device, "preset": a.preset,
                       "repeats": a.repeats, "warmup": a.warmup,
                       "pages": pages, "order": a.order, "churn_cycles": a.churn_cycles if pages != "fresh" else 0,
                       "occupancy": a.occupancy if pages in ("churned", "cache") else None,
                       "host_load_avg_at_start": [round(x, 2) for x in load], "ucx_tls": a.ucx_tls or os.environ.get("UCX_TLS")},
            "pool": raw["pool"], "sizes": rows,
            "ucx": {kind: ucx[agent] for kind, agent in agents.items()},
            "target": {"min_engine_vs_raw": min(big, default=None),
                       "met": None if not big else min(big) >= TARGET_RATIO,
                       "small_engine_vs_raw": small,
                       "small_met": None if small is None else small >= SMALL_TARGET_RATIO}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/kv_transfer"), help="writes OUT.json, OUT.md")
    p.add_argument("--logs", type=Path, help="copy both sides' logs (UCX's tables included) here")
    p.add_argument("--prefill-device", default="cpu", help="cpu or cuda:N (the prefill side pins it)")
    p.add_argument("--decode-device", default="cpu", help="cpu or cuda:N (the decode side pins it)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="request sizes in tokens")
    p.add_argument("--max-tokens", type=int, default=0, help="drop sizes above this (e.g. 16384 on the CPU)")
    p.add_argument("--preset", default="flash", help="the pool layout of this preset (workers/engine/presets.py)")
    p.add_argument("--n-layers", type=int, default=0, help="override the preset's layer count (0: keep it)")
    p.add_argument("--page-size", type=int, default=256, help="tokens per page (SGLang's for DeepSeek-V4)")
    p.add_argument("--pool-pages", type=int, default=0, help="each side's pool (0: twice the largest request; "
                   "churned and cache: the largest fits 1.5 times in what --occupancy leaves free)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ucx-tls", help="UCX_TLS for both sides, as the workers' --ucx-tls (default: UCX's choice)")
    p.add_argument("--pages", default="fresh",
                   help="both pools before the timed requests, one run each of a comma-separated list: fresh; "
                   "churned (--churn-cycles allocate/free cycles of arbitrary sizes, held at --occupancy); scattered "
                   "(every other page held: every free run one page, the worst case); cache (the prefill's pool full "
                   "of a prefix cache after --churn-cycles turns of multi-turn chat, bench/kv_cache_churn.py, its "
                   "allocation making room for each request; the decode's churned)")
    p.add_argument("--order", choices=("prefill-first", "decode-first"), default="prefill-first",
                   help="which side allocates a request's pages first: prefill-first (an idle prefill starts before "
                   "decode's reservation arrives); decode-first (a queued prefill: its pages follow decode's runs)")
    p.add_argument("--occupancy", type=float, default=0.9, help="share of each churned pool held (default 0.9)")
    p.add_argument("--churn-cycles", type=int, default=5000, help="allocate/free cycles (cache: chat turns)")
    p.add_argument("--timeout-s", type=float, default=540.0)
    p.add_argument("--nixl-telemetry", action="store_true", help="NIXL_TELEMETRY_ENABLE=y for both sides: NIXL's "
                   "post and transfer durations of every timed WRITE, tabled per size (also on when it is set already)")
    a = p.parse_args(argv)
    a.sizes = [int(x) for x in a.sizes.split(",") if x and (not a.max_tokens or int(x) <= a.max_tokens)]
    a.pages = [x for x in a.pages.split(",") if x]
    if not a.pages or set(a.pages) - set(PAGE_STATES):
        p.error(f"--pages {','.join(a.pages)}: choose from {', '.join(PAGE_STATES)}")
    if not 0 < a.occupancy < 1:
        p.error(f"--occupancy {a.occupancy}: give a share of the pool in (0, 1)")
    if not a.sizes:
        p.error("--sizes/--max-tokens leave no request size to measure")
    if a.repeats < 1 or a.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if a.preset not in PRESETS:
        p.error(f"--preset {a.preset!r}: choose from {', '.join(PRESETS)}")
    if a.page_size <= 0 or a.n_layers < 0:
        p.error(f"--page-size {a.page_size} / --n-layers {a.n_layers}: give a positive page size, layers >= 0")
    try:                       # the engine's own checks of the layout, on no memory
        build_pool(a.preset, a.n_layers, a.page_size, 1, "meta")
    except ValueError as exc:
        p.error(f"--preset {a.preset} --page-size {a.page_size}: {exc}")
    if a.pool_pages and a.pool_pages < max(-(-t // a.page_size) for t in a.sizes):
        p.error(f"--pool-pages {a.pool_pages}: the largest request needs {-(-max(a.sizes) // a.page_size)} pages")
    for flag, dev in (("--prefill-device", a.prefill_device), ("--decode-device", a.decode_device)):
        if dev != "cpu" and not (dev.startswith("cuda:") and dev[5:].isdigit()):
            p.error(f"{flag} {dev!r}: give cpu or cuda:N")
    return a


def measure(a: argparse.Namespace, pages: str) -> dict:
    """One run of both sides with pools in state `pages`; raises BenchError."""
    with tempfile.TemporaryDirectory(prefix="dsv4-kvx-") as tmp:
        work = Path(tmp)
        load = os.getloadavg()        # this host may be shared: a loaded one makes CPU figures noisy
        try:
            raw = run_sides(a, pages, work)
            return build_report(a, pages, raw, [work / "prefill.log", work / "decode.log"], load)
        finally:
            if a.logs:
                shutil.copytree(tmp, a.logs / pages, dirs_exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # the sides die in finally
    reports, md = {}, ""
    for pages in a.pages:
        try:
            reports[pages] = measure(a, pages)
        except BenchError as exc:
            print(f"kv_transfer ({pages}): {exc}", file=sys.stderr)
            return 1
        md += table(reports[pages]) + "\n"
        print(table(reports[pages]), flush=True)
    write(a.out, next(iter(reports.values())) if len(reports) == 1 else reports, md)
    return 0 if all(r["checks"]["ok"] for rep in reports.values() for r in rep["sizes"]) else 2


if __name__ == "__main__":
    raise SystemExit(main())
