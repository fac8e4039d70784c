"""KV transfer per request size through the engine, against raw NIXL and a device copy, measured in one run.

    python -m bench.kv_transfer --out bench/results/kv_transfer \
        [--prefill-device cuda:0 --decode-device cuda:1] [--pages fresh|churned|scattered] [--max-tokens 16384]

Two processes on this host (`kv_transfer_sides.py`): a prefill side and a decode side, each pinned to its device,
each holding the engine's own KV pool for the preset (`flash` by default: its 4 layers' main, compressed and index
buffers; fp8 on CUDA, one page-major region) in the state `--pages` asks for (fresh; churned by thousands of
allocate/free cycles of mixed sizes; scattered, the worst case), and the engine's own `NixlTransfer`. For each
request size (1K ... 128K tokens) it times, interleaved, over `--repeats` trials:
1. engine: `NixlTransfer.write_pages` of the pages the engine's allocator gave the request on each side, as the
   engine sends them (descriptor lists prepared once per peer, per request only the pages' indices, which NIXL
   merges into one descriptor per run of pages), until the prefill's poll says DONE and the decode side has the
   notification;
2. runs: the same through a new descriptor list per request, one descriptor per region and run of pages
   (`descriptors="runs"`, the engine's previous way);
3. raw NIXL: one WRITE of one contiguous region of the same bytes (one descriptor), to the same completion;
4. copy: `tensor.copy_` of the same bytes from the prefill device to the decode device (a peer copy on two GPUs,
   a copy within the GPU when both are the same, a memcpy on the CPU).
Throughput is bytes / p50 latency (GB = 1e9 B); the ratios come from this one run. Every size is checked: the
bytes written into the decode pool equal the request's pages' bytes, its destination pages hold exactly the
prefill's source bytes. The table gives each request's descriptors and run lengths on both sides, and the pools'
free runs after churn. Which UCX transport carried the bytes is read from UCX's own log (`UCX_PROTO_INFO=y`,
`bench/ucx_proto.py`). Writes OUT.json, OUT.md (and OUT.png when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.orchestrator.processes import death_signal_preexec, log_tail
from dsv4_cluster.workers.presets import PRESETS
from . import ucx_proto
from .kv_transfer_parts import build_pool
from .kv_transfer_sides import PREFILL_AGENT, RUNS_PREFILL_AGENT, RAW_PREFILL_AGENT
from dsv4_cluster.orchestrator.load.loadgen import percentile

SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# engine >= 80% of raw NIXL for requests >= 8K tokens, >= 50% at 1K
TARGET_RATIO, TARGET_MIN_TOKENS, SMALL_TARGET_RATIO, SMALL_TOKENS = 0.8, 8192, 0.5, 1024
METHODS = ("engine", "runs", "raw", "copy")


class BenchError(RuntimeError):
    """A side failed or did not finish in time; the message carries its log's tail."""


def run_sides(a: argparse.Namespace, workdir: Path) -> dict:
    """Start the decode and the prefill side, wait for the prefill's result; neither outlives this call."""
    port = free_ports(1)[0]
    page_count = max(-(-t // a.page_size) for t in a.sizes)
    common = ["--port", str(port), "--sizes", ",".join(map(str, a.sizes)), "--preset", a.preset,
              "--n-layers", str(a.n_layers), "--page-size", str(a.page_size),
              "--pool-pages", str(a.pool_pages or (2 if a.pages == "fresh" else 4) * page_count), "--repeats", str(a.repeats),
              "--warmup", str(a.warmup), *(["--ucx-tls", a.ucx_tls] if a.ucx_tls else []),
              "--pages", a.pages, "--churn-cycles", str(a.churn_cycles)]
    mod = [sys.executable, "-m", "bench.kv_transfer_sides"]
    cmds = {"decode": [*mod, "decode", "--device", a.decode_device, *common],
            "prefill": [*mod, "prefill", "--device", a.prefill_device, "--peer-device", a.decode_device,
                        "--result", str(workdir / "result.json"), *common]}
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info", "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in cmds.items():
            with (workdir / f"{name}.log").open("w") as log:
                procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               preexec_fn=death_signal_preexec(os.getpid()))
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
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


def stats(times: list[float], nbytes: int) -> dict:
    s = sorted(times)
    p50 = percentile(s, 50)
    return {"p50_ms": round(p50 * 1e3, 4), "p99_ms": round(percentile(s, 99) * 1e3, 4),
            "mean_ms": round(sum(s) / len(s) * 1e3, 4), "gb_s": round(nbytes / p50 / 1e9, 3), "n": len(s)}


def summarize(raw: dict) -> list[dict]:
    rows = []
    for size in raw["sizes"]:
        t, n = size["times_s"], size["bytes"]
        row = {k: size[k] for k in ("tokens", "pages", "bytes", "descriptors", "page_runs", "run_lengths", "checks")}
        row.update({m: stats(t[m], n) for m in METHODS})
        row["engine_done_only"] = stats(t["engine_done"], n)    # the prefill's view alone (engine stats)
        row["runs_done_only"] = stats(t["runs_done"], n)
        row["raw_done_only"] = stats(t["raw_done"], n)
        row["ratios"] = {"engine_vs_raw": round(row["engine"]["gb_s"] / row["raw"]["gb_s"], 3),
                         "runs_vs_raw": round(row["runs"]["gb_s"] / row["raw"]["gb_s"], 3),
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
            f"pages: {cfg['pages']}, {cfg['repeats']} repeats (+{cfg['warmup']} warmup), GB/s = bytes / p50 latency.\n\n"
            f"UCX transports of the WRITEs (UCX_PROTO_INFO): engine {_transports(ucx['engine'])}; "
            f"runs {_transports(ucx['runs'])}; raw NIXL {_transports(ucx['raw'])}.\n\n")
    state = pool.get("state", {})
    if cfg["pages"] != "fresh":
        head += "Pools before the timed requests: " + "; ".join(
            f"{side} {st['held_pages']} pages held, {st['free_pages']} free in {st['free_runs']} runs (longest "
            f"{st['longest_free_run']})" for side, st in state.items()) + ".\n\n"
    rows = ["| tokens | MB | descs (runs) | page runs src / dst (max len) | engine GB/s | engine p50 / p99 ms | runs GB/s | "
            "raw GB/s | raw p50 / p99 ms | copy GB/s | engine / raw | runs / raw | engine / copy | checks |",
            "|" + " --- |" * 14]
    for r in report["sizes"]:
        e, pp, w, c = r["engine"], r["runs"], r["raw"], r["copy"]
        rl = r["run_lengths"]
        rows.append(f"| {r['tokens']} | {r['bytes'] / 1e6:.1f} | {r['descriptors']['engine']} | "
                    f"{len(rl['src'])} / {len(rl['dst'])} ({max(rl['src'])} / {max(rl['dst'])}) | {e['gb_s']} | "
                    f"{e['p50_ms']} / {e['p99_ms']} | {pp['gb_s']} | {w['gb_s']} | {w['p50_ms']} / {w['p99_ms']} | "
                    f"{c['gb_s']} | {r['ratios']['engine_vs_raw']} | {r['ratios']['runs_vs_raw']} | "
                    f"{r['ratios']['engine_vs_copy']} | {'ok' if r['checks']['ok'] else 'FAILED'} |")
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


def plot(report: dict, path: Path) -> str:
    try:
        import matplotlib
    except ImportError:
        return "skipped: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = [r["tokens"] for r in report["sizes"]]
    for m in METHODS:
        ax.plot(tokens, [r[m]["gb_s"] for r in report["sizes"]], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request tokens")
    ax.set_ylabel("GB/s (bytes / p50)")
    ax.set_title(f"KV transfer {report['config']['prefill_device']} -> {report['config']['decode_device']}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return str(path.name)


def build_report(a: argparse.Namespace, raw: dict, logs: list[Path], load: tuple[float, ...]) -> dict:
    rows = summarize(raw)
    big = [r["ratios"]["engine_vs_raw"] for r in rows if r["tokens"] >= TARGET_MIN_TOKENS]
    small = next((r["ratios"]["engine_vs_raw"] for r in rows if r["tokens"] == SMALL_TOKENS), None)
    on_gpus = a.prefill_device.startswith("cuda") and a.decode_device.startswith("cuda")
    ucx = ucx_proto.summarize(logs, [PREFILL_AGENT, RUNS_PREFILL_AGENT, RAW_PREFILL_AGENT],
                              "cuda" if on_gpus else "host")
    return {"config": {"prefill_device": a.prefill_device, "decode_device": a.decode_device, "preset": a.preset,
                       "repeats": a.repeats, "warmup": a.warmup,
                       "pages": a.pages, "churn_cycles": a.churn_cycles if a.pages == "churned" else 0,
                       "host_load_avg_at_start": [round(x, 2) for x in load], "ucx_tls": a.ucx_tls or os.environ.get("UCX_TLS")},
            "pool": raw["pool"], "sizes": rows,
            "ucx": {"engine": ucx[PREFILL_AGENT], "runs": ucx[RUNS_PREFILL_AGENT], "raw": ucx[RAW_PREFILL_AGENT]},
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
    p.add_argument("--preset", default="flash", help="the pool layout of this preset (workers/presets.py)")
    p.add_argument("--n-layers", type=int, default=0, help="override the preset's layer count (0: keep it)")
    p.add_argument("--page-size", type=int, default=256, help="tokens per page (SGLang's for DeepSeek-V4)")
    p.add_argument("--pool-pages", type=int, default=0, help="each side's pool (0: twice the largest request)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ucx-tls", help="UCX_TLS for both sides, as the workers' --ucx-tls (default: UCX's choice)")
    p.add_argument("--pages", choices=("fresh", "churned", "scattered"), default="fresh",
                   help="both pools before the timed requests: fresh; churned (--churn-cycles allocate/free cycles "
                   "of mixed sizes, then half of what is held freed); scattered (every other page held: every free "
                   "run one page, the worst case)")
    p.add_argument("--churn-cycles", type=int, default=5000, help="allocate/free cycles of --pages churned")
    p.add_argument("--timeout-s", type=float, default=540.0)
    a = p.parse_args(argv)
    a.sizes = [int(x) for x in a.sizes.split(",") if x and (not a.max_tokens or int(x) <= a.max_tokens)]
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


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # the sides die in finally
    with tempfile.TemporaryDirectory(prefix="dsv4-kvx-") as tmp:
        work = Path(tmp)
        load = os.getloadavg()        # this host may be shared: a loaded one makes CPU figures noisy
        try:
            raw = run_sides(a, work)
            report = build_report(a, raw, [work / "prefill.log", work / "decode.log"], load)
        except BenchError as exc:
            print(f"kv_transfer: {exc}", file=sys.stderr)
            return 1
        finally:
            if a.logs:
                shutil.copytree(tmp, a.logs, dirs_exist_ok=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    report["plot"] = plot(report, a.out.with_suffix(".png"))
    a.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    md = table(report)
    a.out.with_suffix(".md").write_text(md)
    print(md, end="")
    return 0 if all(r["checks"]["ok"] for r in report["sizes"]) else 2


if __name__ == "__main__":
    raise SystemExit(main())
