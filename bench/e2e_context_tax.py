"""Does decode speed depend on the configured context? End to end on one GPU, one command.

    python -m bench.e2e_context_tax --out bench/results/e2e_context_tax --logs LOGDIR

For each configured context (8K, 128K, 1M tokens) it starts a stack: a prefill and a decode worker on GPU 0 (the
`flash` preset, our kernels, decode under CUDA graphs, KV moved GPU -> GPU over NIXL/UCX) and the router; all
stacks are up at once. Then, per concurrency level (1, 16, 64), `--rounds` rounds: each round sends the same
streamed chat requests (2K-token prompts, 128 output tokens, EOS ignored, greedy;
`orchestrator/load/loadgen.py`) through each stack's router in turn (after one untimed run of the level on each), the order rotating from round to round,
so drift in time (GPU clocks, host load) falls on every context alike; an idle stack does no GPU work. Then, alone, a stack at 8K with the kernels off (reference
ops on the GPU, eager) at concurrency 64. Decode tok/s (tokens after each first, over the span requests were
decoding) is reported as ratios from this one run: each context against 8K at the same concurrency (the median
of the per-round ratios, with their range; TPOT p50 likewise), and kernels against reference ops. Every request
of the same index has the same prompt in every setting. (The first H200 runs, one setting after the other with
one short level each, put 0.90-1.04 on the same configuration: drift, not the context.)

Every setting's workers get the same pool (`--pool-tokens`, default the largest context: a request reserves
prompt + max_tokens, not the context), so what changes between settings is only what the configured context
changes: page-table widths of the captured graphs, the indexer's score buffers, the checks on request lengths.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.orchestrator.load.loadgen import LevelSpec, run_level

KERNELS = "sparse_mla_decode,indexer,topk"
CONTEXTS = (8192, 131072, 1048576)
CONCURRENCY = (1, 16, 64)
READY_TIMEOUT_S = 600.0
_TAKEN: set[int] = set()


class Stack:
    """A prefill worker, a decode worker and the router, as processes (GPU 0 for both workers)."""

    def __init__(self, workdir: Path, context: int, kernels: bool, args: argparse.Namespace):
        self.workdir, self.context, self.kernels = workdir, context, kernels
        workdir.mkdir(parents=True, exist_ok=True)
        pp, bp, dp, rp = ports = free_ports(4, exclude=frozenset(_TAKEN))   # stacks run side by side
        _TAKEN.update(ports)
        self.url, self.decode_url = f"http://127.0.0.1:{rp}", f"http://127.0.0.1:{dp}"
        # the router answers /health as soon as it listens: the workers first
        self.ready_urls = [f"http://127.0.0.1:{pp}/health", f"{self.decode_url}/health", f"{self.url}/health"]
        self.model = f"dsv4-{args.preset}"
        common = ["--host", "127.0.0.1", "--device", args.device, "--model-preset", args.preset,
                  "--served-model-name", self.model, "--page-size", str(args.page_size), "--context-length", str(context),
                  "--max-total-tokens", str(args.pool_tokens), "--log-level", "info"]
        if kernels:
            common += ["--kernels", KERNELS]
        py = [sys.executable, "-m"]
        settings = {"host": "127.0.0.1", "port": rp, "model_name": self.model,
                    "prefill": [{"name": "prefill-0", "url": f"http://127.0.0.1:{pp}", "bootstrap_host": "127.0.0.1",
                                 "bootstrap_port": bp}],
                    "decode": [{"name": "decode-0", "url": self.decode_url}]}
        (workdir / "router.json").write_text(json.dumps(settings))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
               "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
        self.cmds = {
            "prefill": [*py, "dsv4_cluster.workers.prefill", "--port", str(pp),
                        "--disaggregation-bootstrap-port", str(bp), "--chunked-prefill-size", "8192", *common],
            "decode": [*py, "dsv4_cluster.workers.decode", "--port", str(dp),
                       "--cuda-graph-max-bs", str(args.graph_bs), *common],
            "router": [*py, "dsv4_cluster.router", "--config", str(workdir / "router.json"),
                       "--log-level", "warning"],
        }
        self.procs: dict[str, subprocess.Popen] = {}
        for name, cmd in self.cmds.items():
            with (workdir / f"{name}.log").open("w") as log:
                self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.ready_urls)
        while pending and time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    tail = (self.workdir / f"{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")
            try:
                if httpx.get(pending[0], timeout=2).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if pending:
            raise TimeoutError(f"{pending[0]} not ready within {timeout_s:.0f}s; logs in {self.workdir}")

    def decode_info(self) -> dict:
        info = httpx.get(self.decode_url + "/server_info", timeout=30).json()
        return {k: info.get(k) for k in ("kernels", "kernel_calls", "decode_steps", "max_total_num_tokens",
                                         "context_length")}

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def label(ctx: int, kernels: bool) -> str:
    return f"{'kernels' if kernels else 'reference'}-ctx{ctx}"


def start_stacks(workdir: Path, plan: list[tuple[int, bool]], args) -> dict[str, "Stack"]:
    """Start every setting's stack at once (`run_settings` waits until they are ready), by label."""
    return {label(ctx, kernels): Stack(workdir / label(ctx, kernels), ctx, kernels, args) for ctx, kernels in plan}


def run_interleaved(stacks: dict[str, Stack], levels: tuple[int, ...], args) -> dict[str, dict]:
    """Every concurrency level, in `args.rounds` rounds; each round runs the level once on every stack, in an order
    that rotates (and reverses every other round), so a drift in time (clocks, host load) falls on every setting
    alike. Returns {label: {"levels": [summary per level], "rounds": {c: [LevelResult dicts]}}}."""
    out: dict[str, dict] = {name: {"levels": [], "rounds": {}} for name in stacks}
    labels = list(stacks)

    def level(name: str, c: int, requests: int) -> dict:
        st = stacks[name]
        spec = LevelSpec(requests=requests, concurrency=c, max_tokens=args.max_tokens, prompt_chars=args.prompt_chars,
                         model=st.model)
        return asyncio.run(run_level(st.url, spec)).to_dict()

    for c in levels:
        for name in labels:          # untimed: a level's first run on a stack pays one-time costs (seen: 0.58x)
            level(name, c, c)
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[: r % len(labels)]
            for name in order[::-1] if r % 2 else order:
                lv = level(name, c, max(c * args.waves, args.min_requests))
                print(f"[context-tax] {name} c={c} round {r + 1}/{args.rounds}: decode {lv['decode_tok_s']} tok/s, "
                      f"TPOT p50 {lv['tpot_p50_s']}s, errors {lv['errors']}", file=sys.stderr, flush=True)
                out[name]["rounds"].setdefault(c, []).append(lv)
        for name in labels:
            out[name]["levels"].append(combine(out[name]["rounds"][c]))
    return out


def combine(rounds: list[dict]) -> dict:
    """One level's summary over its rounds: medians of the rates and latencies, sums of counts."""
    med = lambda key: round(statistics.median(lv[key] for lv in rounds), 5)  # noqa: E731
    errors: dict[str, int] = {}
    for lv in rounds:
        for k, v in (lv["errors_by_reason"] or {}).items():
            errors[k] = errors.get(k, 0) + v
    first = rounds[0]
    return {"concurrency": first["concurrency"], "rounds": len(rounds), "requests": sum(lv["requests"] for lv in rounds),
            "errors": sum(lv["errors"] for lv in rounds), "errors_by_reason": errors,
            "decode_tok_s": round(med("decode_tok_s"), 1), "output_tok_s": round(med("output_tok_s"), 1),
            "ttft_p50_s": med("ttft_p50_s"), "tpot_p50_s": med("tpot_p50_s"), "tpot_p99_s": med("tpot_p99_s"),
            "decode_tok_s_rounds": [lv["decode_tok_s"] for lv in rounds],
            "tpot_p50_s_rounds": [lv["tpot_p50_s"] for lv in rounds]}


def run_settings(workdir: Path, plan: list[tuple[int, bool]], levels: tuple[int, ...], args) -> list[dict]:
    stacks = start_stacks(workdir, plan, args)
    settings: list[dict] = []
    try:
        ready: dict[str, float] = {}
        started = time.monotonic()
        for name, st in list(stacks.items()):
            try:
                st.wait_ready()
                ready[name] = round(time.monotonic() - started, 1)
            except (RuntimeError, TimeoutError, httpx.HTTPError) as e:    # one setting failed: say so, go on
                print(f"[context-tax] {name} failed: {e}", file=sys.stderr, flush=True)
                st.stop()
                del stacks[name]
                settings.append({"label": name, "context": st.context, "kernels": st.kernels,
                                 "error": str(e)[-3000:], "levels": []})
        results = run_interleaved(stacks, levels, args) if stacks else {}
        for name, st in stacks.items():
            settings.append({"label": name, "context": st.context, "kernels": st.kernels, "ready_s": ready[name],
                             **results[name], "decode_server_info": st.decode_info()})
    finally:
        for st in stacks.values():
            st.stop()
    order = [label(c, k) for c, k in plan]
    return sorted(settings, key=lambda s: order.index(s["label"]))


def ratios(settings: list[dict]) -> dict:
    """Each context over the first (8K) at the same concurrency: the median over rounds of the per-round ratio of
    decode tok/s (each round measures both close in time), with its min and max, and the same of TPOT p50 (8K over
    the context: above 1 is slower); kernels over reference ops at the first context."""
    def rounds(label: str, c: int) -> list[dict] | None:
        s = next((s for s in settings if s["label"] == label and not s.get("error")), None)
        got = s["rounds"].get(c) if s else None
        return got if got and all(lv["errors"] == 0 for lv in got) else None

    def per_round(a: list[dict], b: list[dict], key: str, invert: bool = False) -> dict | None:
        rs = [(y[key] / x[key] if invert else x[key] / y[key]) for x, y in zip(a, b) if x[key] and y[key]]
        return {"median": round(statistics.median(rs), 3), "min": round(min(rs), 3), "max": round(max(rs), 3)} \
            if rs else None

    out: dict = {"context_vs_8k": {}, "tpot_8k_over_context": {}, "kernels_vs_reference": {}}
    contexts = [s["context"] for s in settings if s["kernels"]]
    if not contexts:
        return out
    base = contexts[0]
    for ctx in contexts[1:]:
        for c in CONCURRENCY:
            a, b = rounds(label(ctx, True), c), rounds(label(base, True), c)
            key = f"ctx{ctx}_c{c}"
            out["context_vs_8k"][key] = per_round(a, b, "decode_tok_s") if a and b else None
            out["tpot_8k_over_context"][key] = per_round(a, b, "tpot_p50_s", invert=True) if a and b else None
    for c in CONCURRENCY:
        a, b = rounds(label(base, True), c), rounds(label(base, False), c)
        if b and a:
            ka = statistics.median(lv["decode_tok_s"] for lv in a)
            kb = statistics.median(lv["decode_tok_s"] for lv in b)
            out["kernels_vs_reference"][f"ctx{base}_c{c}"] = round(ka / kb, 2)
    return out


def table(report: dict) -> str:
    rows = ["| setting | concurrency | rounds | decode tok/s (median) | x 8K (median of rounds, min-max) | "
            "TPOT p50 ms | 8K/ctx TPOT | TTFT p50 s | errors |", "|" + " --- |" * 9]
    r, t = report["ratios"]["context_vs_8k"], report["ratios"]["tpot_8k_over_context"]
    fmt = lambda x: f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})" if x else "-"  # noqa: E731
    for s in report["settings"]:
        if s.get("error"):
            rows.append(f"| {s['label']} | - | - | failed: {s['error'].splitlines()[0][:120]} | | | | | |")
        for lv in s["levels"]:
            key = "ctx{}_c{}".format(s["context"], lv["concurrency"])
            first = s is report["settings"][0]
            x, y = ("1.000", "1.000") if first else ((fmt(r.get(key)), fmt(t.get(key))) if s["kernels"] else ("-", "-"))
            rows.append(f"| {s['label']} | {lv['concurrency']} | {lv['rounds']} | {lv['decode_tok_s']} | {x} | "
                        f"{lv['tpot_p50_s'] * 1000:.2f} | {y} | {lv['ttft_p50_s']} | {lv['errors_by_reason'] or 0} |")
    kv = ", ".join(f"{k}: {v}x" for k, v in report["ratios"]["kernels_vs_reference"].items())
    return "\n".join(rows) + f"\n\nKernels vs reference ops (decode tok/s): {kv or 'not measured'}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/e2e_context_tax"),
                   help="write OUT.json and OUT.md")
    p.add_argument("--logs", type=Path, help="copy every process's log here")
    p.add_argument("--prompt-chars", type=int, default=2040, help="prompt characters (byte tokens; + the template)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--waves", type=int, default=2, help="requests per level and round: concurrency x this")
    p.add_argument("--rounds", type=int, default=4, help="rounds per level: each runs the level on every context's "
                   "stack in turn (all stacks up at once), so ratios compare runs close in time")
    p.add_argument("--reference-waves", type=int, default=2, help="requests of the kernels-off level: concurrency x this")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level: at least this many")
    p.add_argument("--page-size", type=int, default=256, help="SGLang's V4 pages (flash: a multiple of 128)")
    p.add_argument("--graph-bs", type=int, default=64, help="largest decode batch replayed from a CUDA graph")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--device", default="cuda:0", help="cuda:N (the benchmark; both workers on GPU N); cpu only to try "
                   "the harness")
    p.add_argument("--preset", default="flash", help="flash (the benchmark); tiny only to try the harness on cpu")
    p.add_argument("--reference-concurrency", default="64", help="levels of the kernels-off run at 8K ('' skips)")
    p.add_argument("--pool-tokens", type=int, help="KV pool of every worker in tokens (default: the largest context; "
                   "the same in every setting, so the pool's size is not what differs)")
    a = p.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",") if x]
    a.pool_tokens = a.pool_tokens or max(contexts, default=0)
    ref_levels = tuple(int(x) for x in a.reference_concurrency.split(",") if x)
    if not contexts:
        p.error("--contexts: give at least one, e.g. 8192,131072,1048576")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # stop the stacks (finally)
    settings: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dsv4-ctx-tax-") as tmp:
        try:
            settings += run_settings(Path(tmp), [(ctx, True) for ctx in contexts], CONCURRENCY, a)
            write_report(a, settings)                     # before the reference run: a later kill keeps what ran
            if ref_levels:
                ref_args = argparse.Namespace(**{**vars(a), "rounds": 1, "waves": a.reference_waves})
                settings += run_settings(Path(tmp), [(contexts[0], False)], ref_levels, ref_args)
        finally:
            if a.logs:
                shutil.copytree(tmp, a.logs, dirs_exist_ok=True)
    print(write_report(a, settings), end="")
    ok = all(not s.get("error") and all(lv["errors"] == 0 for lv in s["levels"]) for s in settings)
    return 0 if ok else 2


def write_report(a: argparse.Namespace, settings: list[dict]) -> str:
    report = {"prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens, "page_size": a.page_size,
              "pool_tokens": a.pool_tokens, "rounds": a.rounds, "waves": a.waves,
              "settings": settings, "ratios": ratios([s for s in settings if not s.get("error")])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    md = table(report)
    a.out.with_suffix(".md").write_text(md)
    return md


if __name__ == "__main__":
    raise SystemExit(main())
