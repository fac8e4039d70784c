"""Router benchmark: direct vs ours vs SGLang's gateway (sglang-router 0.3.2 and smg 1.13.0) vs mini_lb, on the same
stub PD servers, one run.

    python -m bench.router [--duration 5] [--concurrency 1 16 64] [--out bench/results] [--profile]

Starts a stub prefill and a stub decode (`router_stubs.py`: the PD protocol, no compute), then for each
router in turn starts it in front of the stubs, checks one streamed chat completion end to end (eight
tokens, `[DONE]`; for PD routers the stubs must have seen both legs with bootstrap fields), and drives it
with `wrk` (streamed `POST /v1/chat/completions`) at each concurrency: req/s, p50, p99, errors. "direct"
sends the same load straight to the stub decode: the floor. Every router routes round robin (one prefill, one
decode: no policy has a choice to make). Ratios are against the faster of the two gateways at each concurrency, in
the same run; `--profile` also samples our router at the highest concurrency (`router_profile.py`). Each measurement starts `SETTLE_S` after the previous load ended. Writes `router.json` and `router.md`
to `--out`; records the machine's load average, because on a shared machine the absolute numbers move from run to
run. It runs itself in a private network namespace whose loopback ACKs at once (`loopback_ns.py`: without it the
Rust router's own Nagle + the load generator's delayed ACK cost it 40 ms a request); `--plain-loopback` to skip.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import httpx

from bench import loopback_ns, router_profile
from dsv4_cluster.orchestrator.launch.ports import free_ports

MODEL = "stub"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}
ROUTERS = ("direct", "ours", "rust", "smg", "mini_lb")
ANCHORS = ("rust", "smg")  # SGLang's gateway: sglang-router 0.3.2 (its last release under that name) and smg 1.13.0
# Pause before each measurement, for every router alike: the previous wrk closed its connections with requests
# in flight, and the aborts and closes that follow (router, stubs, kernel) gave our router p99s over 1 s when
# the next wrk started at once (seen here: 1.0 s without the pause, 0.21 s with it, same run otherwise).
SETTLE_S = 2.0
LABELS = {"direct": "direct to the stub decode (floor)", "ours": "ours (dsv4_cluster.router)",
          "rust": "SGLang Rust router (sglang-router 0.3.2, PD mode)",
          "smg": "SGLang Model Gateway (smg 1.13.0, PD mode)", "mini_lb": "SGLang Python mini_lb"}


@dataclass
class Row:
    router: str
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def parse_wrk(out: str) -> tuple[float, float, float, int, int]:
    """req/s, p50 ms, p99 ms, requests, errors (non-2xx + socket errors) from `wrk --latency` output."""
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, p50, p99, requests, errors + (int(non2xx.group(1)) if non2xx else 0)


def run_wrk(url: str, concurrency: int, duration_s: float, script: Path) -> tuple[float, float, float, int, int]:
    threads = 1 if concurrency < 2 else 2
    cmd = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{duration_s:g}s", "--latency", "-s", str(script),
           url + "/v1/chat/completions"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=duration_s + 60).stdout
    return parse_wrk(out)


def wait_until(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:g} s")


@contextmanager
def process(argv: list[str], health_url: str, log: Path, timeout_s: float = 30.0) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(health_url, timeout_s, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_stream(url: str) -> None:
    """One streamed request: eight content chunks and `[DONE]`, or the router does not count."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, timeout=10) as resp:
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    if resp.status_code != 200 or data[-1:] != ["[DONE]"]:
        raise RuntimeError(f"{url}: status {resp.status_code}, stream {data[:3]}...")
    content = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1])
    if content != "".join(f"t{i} " for i in range(8)):
        raise RuntimeError(f"{url}: streamed {content!r}")


def stub_counts(stub: str) -> dict:
    return httpx.get(stub + "/stats", timeout=5).json()


def router_argv(name: str, port: int, prefill: str, bootstrap: int, decode: str, tmp: Path) -> list[str]:
    if name == "ours":
        settings = {"host": "127.0.0.1", "port": port, "model_name": MODEL,
                    "prefill": [{"name": "prefill-0", "url": prefill, "bootstrap_host": "127.0.0.1",
                                 "bootstrap_port": bootstrap}],
                    "decode": [{"name": "decode-0", "url": decode}]}
        (tmp / "router.json").write_text(json.dumps(settings))
        return [sys.executable, "-m", "dsv4_cluster.router", "--config", str(tmp / "router.json")]
    return anchor_argv(name, port, [(prefill, bootstrap)], [decode]) + (["--mini-lb"] if name == "mini_lb" else [])


def anchor_argv(name: str, port: int, prefills: list[tuple[str, int]], decodes: list[str],
                policy: str = "round_robin") -> list[str]:
    """SGLang's gateway in PD mode on 127.0.0.1:port: sglang-router 0.3.2 (`rust`, `mini_lb`) or smg 1.13.0 (`smg`,
    the same flags under `smg launch`); `policy` for prefill and decode alike, warnings only in its log."""
    launcher = ["smg", "launch"] if name == "smg" else [sys.executable, "-m", "sglang_router.launch_router"]
    argv = launcher + ["--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                       "--log-level", "warn"]
    for url, boot in prefills:
        argv += ["--prefill", url, str(boot)]
    for url in decodes:
        argv += ["--decode", url]
    return argv


def measure(name: str, url: str, args: argparse.Namespace, script: Path, stubs: tuple[str, str],
            pid: int | None = None) -> list[Row]:
    check_stream(url)
    before = [stub_counts(s) for s in stubs]
    rows = []
    run_wrk(url, max(args.concurrency), 1.0, script)  # warm-up: connections, caches
    for c in args.concurrency:
        time.sleep(SETTLE_S)
        rps, p50, p99, n, errors = run_wrk(url, c, args.duration, script)
        rows.append(Row(name, c, round(rps, 1), round(p50, 3), round(p99, 3), n, errors))
        print(f"{name:8s} c={c:3d}: {rps:9.1f} req/s  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms  errors {errors}",
              flush=True)
    if args.profile and name == "ours":
        profile(url, args, script, pid)
    if name != "direct":
        prefill, decode = (stub_counts(s) for s in stubs)
        served = decode["generations"] - before[1]["generations"]
        paired = min(prefill["paired"] - before[0]["paired"], decode["paired"] - before[1]["paired"])
        if paired < served:
            raise RuntimeError(f"{name}: only {paired} of {served} decode requests were paired with a prefill")
    return rows


def profile(url: str, args: argparse.Namespace, script: Path, pid: int) -> None:
    """py-spy on our router under one more run at the highest concurrency, after the measured ones (sampling takes
    CPU from the machine: the measured runs go without it); router_profile.txt beside the numbers."""
    c, raw = max(args.concurrency), args.out / "router_profile.raw"
    time.sleep(SETTLE_S)
    spy = router_profile.start(pid, max(1.0, args.duration - 1), raw)
    if spy is None:
        raise RuntimeError("--profile needs py-spy on PATH (pip install py-spy)")
    rps = run_wrk(url, c, args.duration, script)[0]
    spy.wait(timeout=60)
    (args.out / "router_profile.txt").write_text(
        f"# Our router under `python -m bench.router --profile`: c={c}, {rps:,.0f} req/s while sampled (an extra "
        "run after the measured ones)\n\n" + router_profile.tables(raw.read_text()))
    raw.unlink()


def table(rows: list[Row], concurrency: list[int]) -> str:
    """req/s and latency per router and concurrency; ratios against the faster anchor of the same run at each c."""
    best: dict[int, Row] = {}
    for r in rows:
        if r.router in ANCHORS and (r.concurrency not in best or r.requests_per_s > best[r.concurrency].requests_per_s):
            best[r.concurrency] = r
    head = "| router | " + " | ".join(f"req/s c={c}" for c in concurrency)
    head += " | " + " | ".join(f"p50 / p99 ms c={c}" for c in concurrency) + " | req/s vs the faster anchor |\n"
    head += "|---" * (2 * len(concurrency) + 2) + "|\n"
    lines = []
    for name in ROUTERS:
        mine = {r.concurrency: r for r in rows if r.router == name}
        if not mine:
            continue
        rps = " | ".join(f"{mine[c].requests_per_s:,.0f}" for c in concurrency)
        lat = " | ".join(f"{mine[c].p50_ms:.2f} / {mine[c].p99_ms:.2f}" for c in concurrency)
        ratio = " ".join(f"{mine[c].requests_per_s / best[c].requests_per_s:.2f}x" if c in best else "-"
                         for c in concurrency)
        lines.append(f"| {LABELS[name]} | {rps} | {lat} | {ratio} |")
    return head + "\n".join(lines) + "\n" + verdict(rows, best)


def verdict(rows: list[Row], best: dict[int, Row]) -> str:
    """The targets, from this run: at the highest c req/s >= 1.2x the faster anchor and p99 <= its; at c = 1 p50 <=
    its."""
    ours = {r.concurrency: r for r in rows if r.router == "ours"}
    lines = []
    for c in sorted(set(ours) & set(best)):
        o, a = ours[c], best[c]
        if c == 1:
            lines.append(f"- c = 1: p50 {o.p50_ms:.2f} ms vs {a.router}'s {a.p50_ms:.2f} ms "
                         f"({'met' if o.p50_ms <= a.p50_ms else 'missed'})")
        elif c == max(best):
            ratio = o.requests_per_s / a.requests_per_s
            lines.append(f"- c = {c}: {ratio:.2f}x {a.router}'s req/s (target >= 1.2x: {'met' if ratio >= 1.2 else 'missed'}); "
                         f"p99 {o.p99_ms:.2f} vs {a.p99_ms:.2f} ms ({'met' if o.p99_ms <= a.p99_ms else 'missed'})")
    return ("\nAgainst the faster anchor at each concurrency:\n\n" + "\n".join(lines) + "\n") if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of load per router and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--profile", action="store_true", help="sample our router with py-spy at the highest "
                        "concurrency and write router_profile.txt (bench/router_profile.py)")
    parser.add_argument("--plain-loopback", action="store_true",
                        help="run on the machine's loopback (delayed ACKs: the Rust router stalls ~40 ms per request)")
    args = parser.parse_args(argv)
    if not args.plain_loopback and not loopback_ns.inside():
        return loopback_ns.reexec_in_quickack_netns("bench.router", sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if shutil.which("wrk") is None:
        print("error: wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "post.lua"
        script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                          f"wrk.body = {json.dumps(json.dumps(BODY))}\n")
        prefill_port, bootstrap, decode_port, router_port = free_ports(4)
        prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
        stub = [sys.executable, "-m", "bench.router_stubs", "--port"]
        with process(stub + [str(prefill_port), "--role", "prefill"], prefill + "/health", tmp / "prefill.log"), \
                process(stub + [str(decode_port), "--role", "decode"], decode + "/health", tmp / "decode.log"):
            for name in args.routers:
                if name == "direct":
                    rows += measure(name, decode, args, script, (prefill, decode))
                    continue
                url = f"http://127.0.0.1:{router_port}"
                argv_ = router_argv(name, router_port, prefill, bootstrap, decode, tmp)
                with process(argv_, url + "/health", tmp / f"{name}.log", timeout_s=60) as proc:
                    rows += measure(name, url, args, script, (prefill, decode), proc.pid)
    load_after = os.getloadavg()
    result = {"loopback": "plain" if args.plain_loopback else "private netns, quickack",
              "concurrency": args.concurrency, "duration_s": args.duration, "cpus": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": load_after,
              "body": BODY, "rows": [asdict(r) for r in rows]}
    (args.out / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(rows, args.concurrency)
    note = (f"\n{os.cpu_count()} CPUs; 1-min load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
            f"(other work shares this machine); {args.duration:g} s of wrk per cell, one run; loopback: "
            f"{result['loopback']} (bench/loopback_ns.py says why).\n")
    (args.out / "router.md").write_text("# Router benchmark\n\n`python -m bench.router`\n\n"
                                        + text + note)
    print(text + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
