"""Does decode speed depend on the configured context? End to end on one GPU, one command (docs/benchmarks.md).

    python -m bench.e2e_context_tax --out bench/results/e2e_context_tax --logs LOGDIR

Per configured context a stack (prefill and decode workers on GPU 0, `flash` preset, our kernels, decode under CUDA
graphs, KV over NIXL, the router), all up at once, the same pool in each. Per concurrency, `--rounds` rounds of the
same streamed chat requests (`orchestrator/load/loadgen.py`) through every stack in an order that rotates, so drift
in time falls on every context alike; each level runs once untimed first. Then, alone, the first context with the
kernels off (reference ops, eager). Ratios from this one run: each context against the first (median of per-round
ratios, with their range), kernels against reference ops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ints, md_table, process, versions, wait_http, write
from bench.router import ours_argv
from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.orchestrator.load.loadgen import LevelSpec, run_level

KERNELS = "sparse_mla_decode,indexer,topk"
CONTEXTS, CONCURRENCY = (8192, 131072, 1048576), (1, 16, 64)
READY_TIMEOUT_S = 600.0


class Stack:
    """A prefill worker, a decode worker and the router, as processes (both workers on the same GPU)."""

    def __init__(self, workdir: Path, context: int, kernels: bool, a: argparse.Namespace, taken: set[int]):
        self.workdir, self.context, self.kernels = workdir, context, kernels
        workdir.mkdir(parents=True, exist_ok=True)
        pp, bp, dp, rp = ports = free_ports(4, exclude=frozenset(taken))   # stacks run side by side
        taken.update(ports)
        self.url, self.decode_url, self.model = f"http://127.0.0.1:{rp}", f"http://127.0.0.1:{dp}", f"dsv4-{a.preset}"
        common = ["--host", "127.0.0.1", "--device", a.device, "--model-preset", a.preset, "--served-model-name",
                  self.model, "--page-size", str(a.page_size), "--context-length", str(context), "--max-total-tokens",
                  str(a.pool_tokens), "--log-level", "info", *(["--kernels", KERNELS] if kernels else [])]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
               "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
        py = [sys.executable, "-m"]
        cmds = {"prefill": [*py, "dsv4_cluster.workers.prefill", "--port", str(pp), "--disaggregation-bootstrap-port",
                            str(bp), "--chunked-prefill-size", "8192", *common],
                "decode": [*py, "dsv4_cluster.workers.decode", "--port", str(dp), "--cuda-graph-max-bs", str(a.graph_bs),
                           *common],
                "router": ours_argv(rp, [(f"http://127.0.0.1:{pp}", bp)], [self.decode_url], workdir, "warning",
                                    model_name=self.model)}
        self.exit = contextlib.ExitStack()    # every process started now, each waited for later (wait_ready)
        self.procs = {name: self.exit.enter_context(process(cmd, None, workdir / f"{name}.log", env=env))
                      for name, cmd in cmds.items()}
        # the router answers /health as soon as it listens: the workers first
        self.ready_urls = [f"http://127.0.0.1:{pp}/health", f"{self.decode_url}/health", f"{self.url}/health"]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            for url in self.ready_urls:
                wait_http(url, max(1.0, deadline - time.monotonic()), list(self.procs.values()))
        except (RuntimeError, TimeoutError) as e:
            tails = "\n".join(f"{n}: {(self.workdir / f'{n}.log').read_text()[-1500:]}" for n in self.procs)
            raise RuntimeError(f"{e}\n{tails}") from None

    def decode_info(self) -> dict:
        info = httpx.get(self.decode_url + "/server_info", timeout=30).json()
        return {k: info.get(k) for k in ("kernels", "kernel_calls", "decode_steps", "max_total_num_tokens",
                                         "context_length")}

    def stop(self) -> None:
        self.exit.close()


def run_interleaved(stacks: dict[str, Stack], levels: tuple[int, ...], a) -> dict[str, dict]:
    """Every level in `a.rounds` rounds, each running the level once on every stack in an order that rotates (and
    reverses every other round). {label: {"levels": [summary per level], "rounds": {c: [LevelResult dicts]}}}."""
    out: dict[str, dict] = {name: {"levels": [], "rounds": {}} for name in stacks}
    labels = list(stacks)

    def level(name: str, c: int, requests: int) -> dict:
        spec = LevelSpec(requests=requests, concurrency=c, max_tokens=a.max_tokens, prompt_chars=a.prompt_chars,
                         model=stacks[name].model)
        return asyncio.run(run_level(stacks[name].url, spec)).to_dict()

    for c in levels:
        for name in labels:          # untimed: a level's first run on a stack pays one-time costs (seen: 0.58x)
            level(name, c, c)
        for r in range(a.rounds):
            order = labels[r % len(labels):] + labels[: r % len(labels)]
            for name in order[::-1] if r % 2 else order:
                lv = level(name, c, max(c * a.waves, a.min_requests))
                print(f"[context-tax] {name} c={c} round {r + 1}/{a.rounds}: decode {lv['decode_tok_s']} tok/s, "
                      f"TPOT p50 {lv['tpot_p50_s']}s, errors {lv['errors']}", file=sys.stderr, flush=True)
                out[name]["rounds"].setdefault(c, []).append(lv)
        for name in labels:
            rounds = out[name]["rounds"][c]
            med = lambda key: round(statistics.median(lv[key] for lv in rounds), 5)  # noqa: E731
            errors: dict[str, int] = {}
            for lv in rounds:
                for k, v in (lv["errors_by_reason"] or {}).items():
                    errors[k] = errors.get(k, 0) + v
            out[name]["levels"].append({
                "concurrency": c, "rounds": len(rounds), "requests": sum(lv["requests"] for lv in rounds),
                "errors": sum(lv["errors"] for lv in rounds), "errors_by_reason": errors,
                "decode_tok_s": round(med("decode_tok_s"), 1), "output_tok_s": round(med("output_tok_s"), 1),
                "ttft_p50_s": med("ttft_p50_s"), "tpot_p50_s": med("tpot_p50_s"), "tpot_p99_s": med("tpot_p99_s"),
                "decode_tok_s_rounds": [lv["decode_tok_s"] for lv in rounds],
                "tpot_p50_s_rounds": [lv["tpot_p50_s"] for lv in rounds]})
    return out


def run_settings(workdir: Path, plan: list[tuple[int, bool]], levels: tuple[int, ...], a, taken: set[int]) -> list[dict]:
    labels = [f"{'kernels' if k else 'reference'}-ctx{ctx}" for ctx, k in plan]
    stacks = {name: Stack(workdir / name, ctx, k, a, taken) for name, (ctx, k) in zip(labels, plan)}
    settings: list[dict] = []
    try:
        ready, started = {}, time.monotonic()
        for name, st in list(stacks.items()):
            try:
                st.wait_ready()
                ready[name] = round(time.monotonic() - started, 1)
            except (RuntimeError, httpx.HTTPError) as e:    # one setting failed: say so, go on
                print(f"[context-tax] {name} failed: {e}", file=sys.stderr, flush=True)
                st.stop()
                del stacks[name]
                settings.append({"label": name, "context": st.context, "kernels": st.kernels, "error": str(e)[-3000:],
                                 "levels": []})
        results = run_interleaved(stacks, levels, a) if stacks else {}
        settings += [{"label": name, "context": st.context, "kernels": st.kernels, "ready_s": ready[name],
                      **results[name], "decode_server_info": st.decode_info()} for name, st in stacks.items()]
    finally:
        for st in stacks.values():
            st.stop()
    return sorted(settings, key=lambda s: plan.index((s["context"], s["kernels"])))


def ratios(settings: list[dict]) -> dict:
    """Each context over the first at the same concurrency: the median over rounds of the per-round ratio of decode
    tok/s (each round measures both close in time), with its min and max, and the same of TPOT p50 (first over this
    context: above 1 is slower); kernels over reference ops at the first context."""
    def rounds(kernels: bool, ctx: int, c: int) -> list[dict] | None:
        s = next((s for s in settings if (s["context"], s["kernels"]) == (ctx, kernels) and not s.get("error")), None)
        got = s["rounds"].get(c) if s else None
        return got if got and all(lv["errors"] == 0 for lv in got) else None

    def per_round(x: list[dict], y: list[dict], key: str, invert: bool = False) -> dict | None:
        rs = [(b[key] / a[key] if invert else a[key] / b[key]) for a, b in zip(x, y) if a[key] and b[key]]
        return {"median": round(statistics.median(rs), 3), "min": round(min(rs), 3), "max": round(max(rs), 3)} \
            if rs else None

    out: dict = {"context_vs_8k": {}, "tpot_8k_over_context": {}, "kernels_vs_reference": {}}
    contexts = [s["context"] for s in settings if s["kernels"]]
    for ctx in contexts[1:]:
        for c in CONCURRENCY:
            x, y, key = rounds(True, ctx, c), rounds(True, contexts[0], c), f"ctx{ctx}_c{c}"
            out["context_vs_8k"][key] = per_round(x, y, "decode_tok_s") if x and y else None
            out["tpot_8k_over_context"][key] = per_round(x, y, "tpot_p50_s", invert=True) if x and y else None
    for c in CONCURRENCY if contexts else ():
        x, y = rounds(True, contexts[0], c), rounds(False, contexts[0], c)
        if x and y:
            med = lambda rs: statistics.median(lv["decode_tok_s"] for lv in rs)  # noqa: E731
            out["kernels_vs_reference"][f"ctx{contexts[0]}_c{c}"] = round(med(x) / med(y), 2)
    return out


def table(report: dict) -> str:
    r, t = report["ratios"]["context_vs_8k"], report["ratios"]["tpot_8k_over_context"]
    fmt = lambda x: f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})" if x else "-"  # noqa: E731
    rows = []
    for s in report["settings"]:
        if s.get("error"):
            rows.append([s["label"], "-", "-", f"failed: {s['error'].splitlines()[0][:120]}", "", "", "", "", ""])
        for lv in s["levels"]:
            key, first = f"ctx{s['context']}_c{lv['concurrency']}", s is report["settings"][0]
            x, y = ("1.000", "1.000") if first else ((fmt(r.get(key)), fmt(t.get(key))) if s["kernels"] else ("-", "-"))
            rows.append([s["label"], lv["concurrency"], lv["rounds"], str(lv["decode_tok_s"]), x,
                         f"{lv['tpot_p50_s'] * 1000:.2f}", y, str(lv["ttft_p50_s"]), str(lv["errors_by_reason"] or 0)])
    kv = ", ".join(f"{k}: {v}x" for k, v in report["ratios"]["kernels_vs_reference"].items())
    return "\n".join(md_table(["setting", "concurrency", "rounds", "decode tok/s (median)",
                               "x 8K (median of rounds, min-max)", "TPOT p50 ms", "8K/ctx TPOT", "TTFT p50 s", "errors"],
                              rows)) + f"\n\nKernels vs reference ops (decode tok/s): {kv or 'not measured'}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/e2e_context_tax"), help="write OUT.json and OUT.md")
    p.add_argument("--logs", type=Path, help="copy every process's log here")
    p.add_argument("--prompt-chars", type=int, default=2040, help="prompt characters (byte tokens; + the template)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--waves", type=int, default=2, help="requests per level and round: concurrency x this")
    p.add_argument("--rounds", type=int, default=4, help="rounds per level, each over every context's stack in turn")
    p.add_argument("--reference-waves", type=int, default=2, help="requests of the kernels-off level: concurrency x this")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level: at least this many")
    p.add_argument("--page-size", type=int, default=256, help="SGLang's V4 pages (flash: a multiple of 128)")
    p.add_argument("--graph-bs", type=int, default=64, help="largest decode batch replayed from a CUDA graph")
    p.add_argument("--contexts", type=ints, default=list(CONTEXTS))
    p.add_argument("--device", default="cuda:0", help="cuda:N (both workers on GPU N); cpu only to try the harness")
    p.add_argument("--preset", default="flash", help="flash (the benchmark); tiny only to try the harness on cpu")
    p.add_argument("--reference-concurrency", type=ints, default=[64], help="levels of the kernels-off run at 8K "
                   "('' skips)")
    p.add_argument("--pool-tokens", type=int, help="KV pool of every worker in tokens (default: the largest context)")
    a = p.parse_args(argv)
    if not a.contexts:
        p.error("--contexts: give at least one, e.g. 8192,131072,1048576")
    a.pool_tokens = a.pool_tokens or max(a.contexts)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))   # stop the stacks (finally)
    settings, taken = [], set()
    with tempfile.TemporaryDirectory(prefix="dsv4-ctx-tax-") as tmp:
        try:
            settings += run_settings(Path(tmp), [(ctx, True) for ctx in a.contexts], CONCURRENCY, a, taken)
            write_report(a, settings)                     # before the reference run: a later kill keeps what ran
            if a.reference_concurrency:
                ref = argparse.Namespace(**{**vars(a), "rounds": 1, "waves": a.reference_waves})
                settings += run_settings(Path(tmp), [(a.contexts[0], False)], tuple(a.reference_concurrency), ref, taken)
        finally:
            if a.logs:
                shutil.copytree(tmp, a.logs, dirs_exist_ok=True)
    print(write_report(a, settings), end="")
    return 0 if all(not s.get("error") and all(lv["errors"] == 0 for lv in s["levels"]) for s in settings) else 2


def write_report(a: argparse.Namespace, settings: list[dict]) -> str:
    report = {"prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens, "page_size": a.page_size,
              "pool_tokens": a.pool_tokens, "rounds": a.rounds, "waves": a.waves, "versions": versions(), "settings": settings,
              "ratios": ratios([s for s in settings if not s.get("error")])}
    write(a.out, report, md := table(report))
    return md


if __name__ == "__main__":
    raise SystemExit(main())
