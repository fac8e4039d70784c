"""Router benchmark: direct vs ours vs SGLang's gateway (sglang-router 0.3.2 and smg 1.13.0) vs mini_lb, on the same
stub PD workers; `--repeat` passes, medians shown (docs/benchmarks.md).

    python -m bench.router [--duration 5] [--concurrency 1 16 64] [--repeat 3] [--out bench/results] [--profile]

Each router in turn in front of one stub prefill and decode (`stubs.py`), checked with one streamed chat completion
(PD routers must pair every request: the stubs count bootstrap fields), then driven by `wrk` at each concurrency;
"direct" loads the stub decode itself (the floor). Ratios are against the faster gateway of the same run.
`--profile` samples our router with py-spy in one more run (`router_profile.txt`). Runs in a private network
namespace whose loopback ACKs at once (`loopback_ns.py`); `--plain-loopback` to skip.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench import loopback_ns
from bench.common import RESULTS, STOP_S, cpu_seconds, machine, md_table, process
from dsv4_cluster.orchestrator.launch.ports import free_ports

MODEL = "stub"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}
ROUTERS = ("direct", "ours", "rust", "smg", "mini_lb")
ANCHORS = ("rust", "smg")  # SGLang's gateway: sglang-router 0.3.2 (its last release under that name) and smg 1.13.0
ANCHOR_STOP_S = 1.0  # SIGTERM to SIGKILL for a gateway: smg 1.13.0 drains for 5 s, which nothing here needs
# The previous wrk closed its connections with requests in flight; the aborts and closes that follow gave our router
# p99s over 1 s when the next wrk started at once (1.0 s without the pause, 0.21 s with it, same run otherwise).
SETTLE_S = 2.0
LABELS = {"direct": "direct to the stub decode (floor)", "ours": "ours (dsv4_cluster.router)",
          "rust": "SGLang Rust router (sglang-router 0.3.2, PD mode)",
          "smg": "SGLang Model Gateway (smg 1.13.0, PD mode)", "mini_lb": "SGLang Python mini_lb"}
PROFILED = ("router/", "uvicorn/", "starlette/", "prometheus_client/", "pydantic/")


@dataclass
class Row:
    router: str
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    router_cores: float | None = None         # the router's CPU seconds (every process of its session) / wall seconds
    cpu_us_per_request: float | None = None   # ... / requests: what one request costs it, whatever cores it has
    run: int = 0                              # which pass over the routers (`--repeat`)


def parse_wrk(out: str) -> tuple[float, float, float, int, int]:
    """req/s, p50 ms, p99 ms, requests, errors (non-2xx + socket errors) from `wrk --latency` output."""
    def ms(q: str) -> float:
        value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", re.search(rf"^\s+{q}%\s+(\S+)", out, re.M)[1]).groups()
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]

    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return (float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]), ms("50"), ms("99"),
            int(re.search(r"(\d+) requests in", out)[1]), errors + (int(non2xx[1]) if non2xx else 0))


def run_wrk(url: str, concurrency: int, duration_s: float, script: Path) -> tuple[float, float, float, int, int]:
    cmd = ["wrk", f"-t{1 if concurrency < 2 else 2}", f"-c{concurrency}", f"-d{duration_s:g}s", "--latency", "-s",
           str(script), url + "/v1/chat/completions"]
    return parse_wrk(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=duration_s + 60).stdout)


def check_stream(url: str) -> None:
    """One streamed request: eight content chunks and `[DONE]`, or the router does not count."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, timeout=10) as resp:
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    if resp.status_code != 200 or data[-1:] != ["[DONE]"]:
        raise RuntimeError(f"{url}: status {resp.status_code}, stream {data[:3]}...")
    content = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1])
    if content != "".join(f"t{i} " for i in range(8)):
        raise RuntimeError(f"{url}: streamed {content!r}")


def ours_argv(port: int, prefills: list[tuple[str, int]], decodes: list[str], tmp: Path, log_level: str = "info",
              **settings) -> list[str]:
    """Our router on 127.0.0.1:port (its settings file in `tmp`)."""
    settings = {"host": "127.0.0.1", "port": port, "model_name": MODEL, **settings,
                "prefill": [{"name": f"prefill-{i}", "url": u, "bootstrap_host": "127.0.0.1", "bootstrap_port": b}
                            for i, (u, b) in enumerate(prefills)],
                "decode": [{"name": f"decode-{i}", "url": u} for i, u in enumerate(decodes)]}
    (tmp / "router.json").write_text(json.dumps(settings))
    return [sys.executable, "-m", "dsv4_cluster.router", "--config", str(tmp / "router.json"), "--log-level", log_level]


def stop_wait_s(name: str) -> float:
    """SIGTERM to SIGKILL for the router `name` (`bench.common.process`): a gateway gets `ANCHOR_STOP_S`."""
    return ANCHOR_STOP_S if name in ANCHORS else STOP_S


def anchor_versions() -> dict[str, str]:
    """What each gateway says it is, run as `anchor_argv` runs it: by module, because sglang-router 0.3.2 and smg
    1.13.0 both install a `smg` script and the package installed last owns it (seen: `smg` running 0.3.2)."""
    smg = subprocess.run([sys.executable, "-m", "smg", "--version"], capture_output=True, text=True, timeout=60)
    try:
        from sglang_router.version import __version__ as rust
    except ImportError:
        rust = None
    return {"rust": f"sglang-router {rust}" if rust else "sglang-router: not installed",
            "smg": smg.stdout.strip() or smg.stderr.strip()[-200:]}


def anchor_argv(name: str, port: int, prefills: list[tuple[str, int]], decodes: list[str],
                policy: str = "round_robin") -> list[str]:
    """SGLang's gateway in PD mode on 127.0.0.1:port: sglang-router 0.3.2 (`rust`, `mini_lb`) or smg 1.13.0 (`smg`,
    the same flags under `python -m smg launch`); `policy` for prefill and decode alike, warnings only in its log; its
    metrics exporter on a free loopback port (its default port is fixed: a second gateway on the machine would exit)."""
    launcher = [sys.executable, "-m", "smg", "launch"] if name == "smg" else \
        [sys.executable, "-m", "sglang_router.launch_router"]
    argv = launcher + ["--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                       "--log-level", "warn", "--prometheus-host", "127.0.0.1",
                       "--prometheus-port", str(free_ports(1, exclude=frozenset({port}))[0])] + \
        (["--mini-lb"] if name == "mini_lb" else [])
    return argv + [x for url, boot in prefills for x in ("--prefill", url, str(boot))] + \
        [x for url in decodes for x in ("--decode", url)]


def measure(name: str, url: str, args: argparse.Namespace, script: Path, stubs: tuple[str, str],
            pid: int | None = None, run: int = 0, pairing: dict[str, list[int]] | None = None) -> list[Row]:
    check_stream(url)
    counts = lambda: [httpx.get(s + "/stats", timeout=5).json() for s in stubs]  # noqa: E731
    before, rows = counts(), []
    run_wrk(url, max(args.concurrency), 1.0, script)  # warm-up: connections, caches
    for c in args.concurrency:
        time.sleep(SETTLE_S)
        cpu0, t0 = (cpu_seconds(pid, session=True) if pid else 0.0), time.monotonic()
        rps, p50, p99, n, errors = run_wrk(url, c, args.duration, script)
        cpu, wall = (cpu_seconds(pid, session=True) - cpu0 if pid else None), time.monotonic() - t0
        row = Row(name, c, round(rps, 1), round(p50, 3), round(p99, 3), n, errors,
                  None if cpu is None else round(cpu / wall, 2), None if cpu is None else round(1e6 * cpu / n), run)
        rows.append(row)
        print(f"{name:8s} c={c:3d}: {rps:9.1f} req/s  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms  errors {errors}"
              + ("" if cpu is None else
                 f"  {row.router_cores:.2f} cores, {row.cpu_us_per_request:.0f} CPU us a request"), flush=True)
    if args.profile and name == "ours" and run == args.repeat - 1:
        profile(url, args, script, pid)
    if name != "direct":
        (p0, d0), (p1, d1) = before, counts()
        served, paired = d1["generations"] - d0["generations"], min(p1["paired"] - p0["paired"], d1["paired"] - d0["paired"])
        # each wrk run ends by closing its connections: up to c requests are cut in flight, and a router may have
        # sent one leg of those alone (smg 1.13.0 did: 2 of 73,214 in one run)
        cut = max(args.concurrency) + sum(args.concurrency)
        if paired < served - cut:
            raise RuntimeError(f"{name}: only {paired} of {served} decode requests were paired with a prefill "
                               f"(at most {cut} may be cut in flight)")
        if paired < served:
            print(f"{name}: {served - paired} decode requests without their prefill (cut in flight: <= {cut})")
        if pairing is not None:   # the anchor check the table prints: a PD router pairs what it serves
            total = pairing.setdefault(name, [0, 0])
            total[0], total[1] = total[0] + paired, total[1] + served
    return rows


def profile(url: str, args: argparse.Namespace, script: Path, pid: int) -> None:
    """py-spy on our router during one more run at the highest concurrency, after the measured ones (sampling takes
    CPU from the machine); router_profile.txt beside the numbers."""
    spy, c, raw = shutil.which("py-spy"), max(args.concurrency), args.out / "router_profile.raw"
    if spy is None:
        raise RuntimeError("--profile needs py-spy on PATH (pip install py-spy)")
    time.sleep(SETTLE_S)
    # --nonblocking: the router is not stopped for each sample (blocking sampling at 250 Hz cut it to ~1/6 its rate)
    proc = subprocess.Popen([spy, "record", "--nonblocking", "--rate", "250",
                             "--duration", f"{max(1.0, args.duration - 1):g}",
                             "--format", "raw", "--output", str(raw), "--pid", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rps = run_wrk(url, c, args.duration, script)[0]
    proc.wait(timeout=60)
    (args.out / "router_profile.txt").write_text(
        f"# Our router under `python -m bench.router --profile`: c={c}, {rps:,.0f} req/s while sampled (an extra "
        "run after the measured ones)\n\n" + profile_tables(raw.read_text()))
    raw.unlink()


def profile_tables(raw_text: str, top: int = 30) -> str:
    """Self and inclusive sample shares from py-spy's folded stacks ('frame;frame;... count' per line)."""
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in raw_text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for f in stack.split(";"):   # 'func (path/to/file.py:12)' -> 'func to/file.py:12'
            func, _, where = f.partition(" (")
            frames.append(f"{func} {'/'.join(where.rstrip(')').split('/')[-2:])}" if where else func)
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    if not total:
        return "no samples\n"
    mine = [(f, n) for f, n in inclusive.most_common() if any(k in f for k in PROFILED) and n < total]
    return "\n".join([f"{total} samples", "", "self (where the time is spent):",
                      *(f"{100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)), "",
                      "inclusive (the router's own frames and its server's):",
                      *(f"{100 * n / total:5.1f}%  {f}" for f, n in mine[:top])]) + "\n"


def _cpu(row: Row) -> str:
    return "-" if row.router_cores is None else f"{row.router_cores:.2f} / {row.cpu_us_per_request:,.0f}"


def medians(rows: list[Row]) -> list[Row]:
    """One row per router and concurrency: the median of each figure over the passes (errors summed)."""
    cells: dict[tuple[str, int], list[Row]] = collections.defaultdict(list)
    for r in rows:
        cells[(r.router, r.concurrency)].append(r)
    med = lambda xs: None if None in xs else statistics.median(xs)  # noqa: E731
    return [Row(name, c, med([r.requests_per_s for r in rs]), med([r.p50_ms for r in rs]), med([r.p99_ms for r in rs]),
                sum(r.requests for r in rs), sum(r.errors for r in rs), med([r.router_cores for r in rs]),
                med([r.cpu_us_per_request for r in rs]), -1) for (name, c), rs in cells.items()]


def per_run_ratios(rows: list[Row], c: int) -> str:
    """Ours over the faster anchor at concurrency `c`, pass by pass."""
    out = []
    for run in sorted({r.run for r in rows}):
        mine = {r.router: r.requests_per_s for r in rows if r.run == run and r.concurrency == c}
        anchors = [mine[a] for a in ANCHORS if a in mine]
        if "ours" in mine and anchors:
            out.append(f"{mine['ours'] / max(anchors):.2f}x")
    return ", ".join(out)


def table(rows: list[Row], concurrency: list[int]) -> str:
    """req/s and latency per router and concurrency (medians over the passes); ratios against the faster anchor at
    each c, and the targets: at the highest c req/s >= 1.2x the faster anchor and p99 <= its; at c = 1 p50 <= its."""
    passes = len({r.run for r in rows})
    runs, rows = rows, medians(rows)
    best: dict[int, Row] = {}
    for r in rows:
        if r.router in ANCHORS and r.requests_per_s > getattr(best.get(r.concurrency), "requests_per_s", -1):
            best[r.concurrency] = r
    body = []
    for name in ROUTERS:
        mine = {r.concurrency: r for r in rows if r.router == name}
        if mine:
            body.append([LABELS[name], *(f"{mine[c].requests_per_s:,.0f}" for c in concurrency),
                         *(f"{mine[c].p50_ms:.2f} / {mine[c].p99_ms:.2f}" for c in concurrency),
                         " ".join(f"{mine[c].requests_per_s / best[c].requests_per_s:.2f}x" if c in best else "-"
                                  for c in concurrency), _cpu(mine[max(concurrency)])])
    lines = md_table(["router", *(f"req/s c={c}" for c in concurrency),
                      *(f"p50 / p99 ms c={c}" for c in concurrency), "req/s vs the faster anchor",
                      f"router cores / CPU us a request c={max(concurrency)}"], body)
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    ours, verdict = {r.concurrency: r for r in rows if r.router == "ours"}, []
    for c in sorted(set(ours) & set(best)):
        o, a = ours[c], best[c]
        if c == 1:
            verdict.append(f"- c = 1: p50 {o.p50_ms:.2f} ms vs {a.router}'s {a.p50_ms:.2f} ms ({met(o.p50_ms <= a.p50_ms)})")
        elif c == max(best):
            ratio = o.requests_per_s / a.requests_per_s
            verdict.append(f"- c = {c}: {ratio:.2f}x {a.router}'s req/s (target >= 1.2x: {met(ratio >= 1.2)}); "
                           f"p99 {o.p99_ms:.2f} vs {a.p99_ms:.2f} ms ({met(o.p99_ms <= a.p99_ms)})")
    if passes > 1:
        verdict.append(f"- ours / the faster anchor at c = {max(concurrency)}, pass by pass: "
                       f"{per_run_ratios(runs, max(concurrency))}")
    return "\n".join(lines) + "\n" + (f"\nAgainst the faster anchor at each concurrency (medians of {passes} "
                                      f"pass{'es' if passes > 1 else ''}):\n\n" + "\n".join(verdict) + "\n"
                                      if verdict else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds of load per router and concurrency")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--profile", action="store_true", help="sample our router with py-spy at the highest concurrency")
    p.add_argument("--repeat", type=int, default=1, help="passes over all routers; the table shows each cell's median "
                   "(this machine's speed moves by up to 1.7x between runs)")
    p.add_argument("--plain-loopback", action="store_true",
                   help="run on the machine's loopback (delayed ACKs: the Rust router stalls ~40 ms per request)")
    args = p.parse_args(argv)
    if not args.plain_loopback and not loopback_ns.inside():
        return loopback_ns.reexec_in_quickack_netns("bench.router", sys.argv[1:] if argv is None else argv)
    if shutil.which("wrk") is None:
        print("error: wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    before, rows, pairing = machine(), [], {}
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "post.lua"
        script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                          f"wrk.body = {json.dumps(json.dumps(BODY))}\n")
        prefill_port, bootstrap, decode_port, router_port = free_ports(4)
        prefill, decode, url = (f"http://127.0.0.1:{port}" for port in (prefill_port, decode_port, router_port))
        stub = [sys.executable, "-m", "bench.stubs", "--port"]
        with process(stub + [str(prefill_port), "--role", "prefill"], prefill + "/health", tmp / "prefill.log"), \
                process(stub + [str(decode_port), "--role", "decode"], decode + "/health", tmp / "decode.log"):
            for run in range(args.repeat):   # whole passes, so that each router meets the machine's slow phases
                for name in args.routers:
                    if name == "direct":
                        rows += measure(name, decode, args, script, (prefill, decode), run=run)
                        continue
                    argv_ = (ours_argv(router_port, [(prefill, bootstrap)], [decode], tmp) if name == "ours" else
                             anchor_argv(name, router_port, [(prefill, bootstrap)], [decode]))
                    with process(argv_, url + "/health", tmp / f"{name}.log", timeout_s=60,
                                 stop_s=stop_wait_s(name)) as proc:
                        rows += measure(name, url, args, script, (prefill, decode), proc.pid, run, pairing)
    after, anchors = machine(), anchor_versions()
    loopback = "plain" if args.plain_loopback else "private netns, quickack"
    result = {"loopback": loopback, "anchors": anchors, "concurrency": args.concurrency, "duration_s": args.duration,
              "passes": args.repeat, "cpus": after["cpus"],
              "load_average_before": before["loadavg"], "load_average_after": after["loadavg"], "body": BODY,
              "pairing": {n: {"paired": p, "served": s} for n, (p, s) in pairing.items()},
              "rows": [asdict(r) for r in rows]}
    (args.out / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    checks = "\nPairing check (a PD router sends each decode request's prefill leg; the stubs count both): " + \
        "; ".join(f"{LABELS[n]} {p:,} of {s:,} paired" for n, (p, s) in pairing.items()) + ".\n" + \
        "Gateways as run (each says so itself): " + ", ".join(anchors.values()) + ".\n"
    text = table(rows, args.concurrency) + checks + (
        f"\n{after['cpus']} CPUs; 1-min load average {before['loadavg'][0]:.1f} before, {after['loadavg'][0]:.1f} "
        f"after; {args.duration:g} s of wrk per cell, {args.repeat} pass{'es' if args.repeat > 1 else ''} over the "
        f"routers, medians shown; loopback: {loopback} "
        "(bench/loopback_ns.py says why).\n")
    (args.out / "router.md").write_text("# Router benchmark\n\n`python -m bench.router`\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
