"""Does decode speed depend on the configured context? End to end on one GPU, one command.

    python -m dsv4_cluster.bench.e2e_context_tax --out bench/results/e2e_context_tax --logs LOGDIR

For each configured context (8K, 128K, 1M tokens) it starts a prefill and a decode worker on GPU 0 (the `flash`
preset, our kernels, decode under CUDA graphs, KV moved GPU -> GPU over NIXL/UCX) and the router, then sends
the same streamed chat requests (2K-token prompts, 128 output tokens, EOS ignored, greedy) through the router at
concurrency 1, 16 and 64 (`loadgen.py`), and stops them. Then once more at 8K with the kernels off (reference
ops on the GPU, eager), at concurrency 64. Decode tok/s (tokens after each first, over the span requests were
decoding) is reported as ratios from this one run: each context against 8K at the same concurrency, and
kernels against reference ops. Every request of the same index has the same prompt in every setting.

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ..orchestrator.ports import free_ports
from .loadgen import LevelSpec, run_level

KERNELS = "sparse_mla_decode,indexer,topk"
CONTEXTS = (8192, 131072, 1048576)
CONCURRENCY = (1, 16, 64)
READY_TIMEOUT_S = 600.0


class Stack:
    """A prefill worker, a decode worker and the router, as processes (GPU 0 for both workers)."""

    def __init__(self, workdir: Path, context: int, kernels: bool, args: argparse.Namespace):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        pp, bp, dp, rp = free_ports(4)
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


def run_setting(workdir: Path, context: int, kernels: bool, levels: tuple[int, ...], args) -> dict:
    label = f"{'kernels' if kernels else 'reference'}-ctx{context}"
    stack = Stack(workdir / label, context, kernels, args)
    started = time.monotonic()
    try:
        stack.wait_ready()
        ready_s = time.monotonic() - started
        results = []
        for c in levels:
            spec = LevelSpec(requests=max(c * args.waves, args.min_requests), concurrency=c, max_tokens=args.max_tokens,
                             prompt_chars=args.prompt_chars, model=stack.model)
            lv = asyncio.run(run_level(stack.url, spec)).to_dict()
            print(f"[context-tax] {label} c={c}: decode {lv['decode_tok_s']} tok/s, output {lv['output_tok_s']} "
                  f"tok/s, TPOT p50 {lv['tpot_p50_s']}s, errors {lv['errors']}", file=sys.stderr, flush=True)
            results.append(lv)
        return {"label": label, "context": context, "kernels": kernels, "ready_s": round(ready_s, 1),
                "levels": results, "decode_server_info": stack.decode_info()}
    finally:
        stack.stop()


def ratios(settings: list[dict]) -> dict:
    """Decode tok/s of each context over the first's (8K) at the same concurrency; kernels over reference there."""
    def rate(label: str, c: int) -> float | None:
        s = next((s for s in settings if s["label"] == label), None)
        lv = next((lv for lv in s["levels"] if lv["concurrency"] == c), None) if s else None
        return lv["decode_tok_s"] if lv and lv["errors"] == 0 else None

    out: dict = {"context_vs_8k": {}, "kernels_vs_reference": {}}
    contexts = [s["context"] for s in settings if s["kernels"]]
    if not contexts:
        return out
    base = contexts[0]
    for ctx in contexts[1:]:
        for c in CONCURRENCY:
            a, b = rate(f"kernels-ctx{ctx}", c), rate(f"kernels-ctx{base}", c)
            out["context_vs_8k"][f"ctx{ctx}_c{c}"] = round(a / b, 3) if a and b else None
    for c in CONCURRENCY:
        a, b = rate(f"kernels-ctx{base}", c), rate(f"reference-ctx{base}", c)
        if b:
            out["kernels_vs_reference"][f"ctx{base}_c{c}"] = round(a / b, 2) if a else None
    return out


def table(report: dict) -> str:
    rows = ["| setting | concurrency | decode tok/s | x 8K | output tok/s | TTFT p50 s | TPOT p50 ms | TPOT p99 ms "
            "| errors |", "|" + " --- |" * 9]
    r = report["ratios"]["context_vs_8k"]
    for s in report["settings"]:
        if s.get("error"):
            rows.append(f"| {s['label']} | - | failed: {s['error'].splitlines()[0][:120]} | | | | | | |")
        for lv in s["levels"]:
            c = lv["concurrency"]
            key = "ctx{}_c{}".format(s["context"], c)
            first = s is report["settings"][0]
            x = "1.000" if first else (str(r.get(key)) if s["kernels"] else "-")
            rows.append(f"| {s['label']} | {c} | {lv['decode_tok_s']} | {x} | {lv['output_tok_s']} | "
                        f"{lv['ttft_p50_s']} | {lv['tpot_p50_s'] * 1000:.2f} | {lv['tpot_p99_s'] * 1000:.2f} | "
                        f"{lv['errors_by_reason'] or 0} |")
    kv = ", ".join(f"{k}: {v}x" for k, v in report["ratios"]["kernels_vs_reference"].items())
    return "\n".join(rows) + f"\n\nKernels vs reference ops (decode tok/s): {kv or 'not measured'}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/e2e_context_tax"),
                   help="write OUT.json and OUT.md")
    p.add_argument("--logs", type=Path, help="copy every process's log here")
    p.add_argument("--prompt-chars", type=int, default=2040, help="prompt characters (byte tokens; + the template)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--waves", type=int, default=8, help="requests per level: concurrency x this (the first H200 run "
                   "used 1 wave: 0.5-2.3 s per level, too short to trust a ratio)")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level: at least this many")
    p.add_argument("--page-size", type=int, default=256, help="SGLang's V4 pages (flash: a multiple of 128)")
    p.add_argument("--graph-bs", type=int, default=64, help="largest decode batch replayed from a CUDA graph")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to try the harness")
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
    plan = [(ctx, True, CONCURRENCY) for ctx in contexts] + ([(contexts[0], False, ref_levels)] if ref_levels else [])
    settings: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dsv4-ctx-tax-") as tmp:
        try:
            for ctx, kernels, levels in plan:
                try:
                    settings.append(run_setting(Path(tmp), ctx, kernels, levels, a))
                except (RuntimeError, TimeoutError, httpx.HTTPError) as e:   # one setting failed: say so, go on
                    label = f"{'kernels' if kernels else 'reference'}-ctx{ctx}"
                    print(f"[context-tax] {label} failed: {e}", file=sys.stderr, flush=True)
                    settings.append({"label": label, "context": ctx, "kernels": kernels, "error": str(e)[-3000:],
                                     "levels": []})
                write_report(a, settings)                 # after every setting: a later kill keeps what ran
        finally:
            if a.logs:
                shutil.copytree(tmp, a.logs, dirs_exist_ok=True)
    print(write_report(a, settings), end="")
    ok = all(not s.get("error") and all(lv["errors"] == 0 for lv in s["levels"]) for s in settings)
    return 0 if ok else 2


def write_report(a: argparse.Namespace, settings: list[dict]) -> str:
    report = {"prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens, "page_size": a.page_size,
              "pool_tokens": a.pool_tokens,
              "settings": settings, "ratios": ratios([s for s in settings if not s.get("error")])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    md = table(report)
    a.out.with_suffix(".md").write_text(md)
    return md


if __name__ == "__main__":
    raise SystemExit(main())
