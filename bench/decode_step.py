"""Decode step time of the embedded engine against the configured context, in one process (no HTTP, no prefill
competing for the GPU): what `e2e_context_tax.py` measures end to end, with the engine alone.

    python -m bench.decode_step --out bench/results/decode_step

Per configured context the decode side's `ModelRunner` (`flash`, our kernels, CUDA graphs, the same pool in every
setting), B requests of 2K random tokens prefilled, then `runner.decode` timed over `--steps` steps per batch size,
and the bare graph replay (CUDA events). Ratios against the first context at the same batch size, from one run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import ints, md_table, versions, write
from dsv4_cluster.workers.engine.presets import model_config
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig

KERNELS = ("sparse_mla_decode", "indexer", "topk")


def measure(context: int, batches: tuple[int, ...], a: argparse.Namespace) -> dict:
    runner = ModelRunner(RunnerConfig(model=model_config(a.preset, seed=0), page_size=a.page_size,
                                      max_total_tokens=a.pool_tokens, context_length=context, device="cuda",
                                      kernels=KERNELS, cuda_graph_max_bs=max(batches)))
    g = torch.Generator().manual_seed(0)
    bmax = max(batches)
    prompts = [torch.randint(1, 200, (a.prompt_tokens,), generator=g).tolist() for _ in range(bmax)]
    budget = a.prompt_tokens + a.steps * (a.repeats + 1) + 8
    pages = [runner.pool.alloc(budget) for _ in prompts]
    first = [int(runner.prefill(p, pg).argmax()) for p, pg in zip(prompts, pages)]
    rows = []
    for b in batches:
        pos = [a.prompt_tokens] * b
        toks = first[:b]
        wall, dev = [], []
        for r in range(a.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                logits = runner.decode(toks, pos, pages[:b])
                toks = logits.argmax(-1).tolist()
                pos = [p + 1 for p in pos]
            per_step = (time.perf_counter() - t0) / a.steps
            if r:                                     # the first repeat warms up
                wall.append(per_step)
            # the bare replay of this batch's graph at the same lengths (device time, CUDA events)
            bs = runner.graphs.size_for(b)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.steps):
                runner.graphs.graphs[bs].replay()
            end.record()
            end.synchronize()
            if r:
                dev.append(start.elapsed_time(end) / 1000 / a.steps)
            pos = [p - a.steps for p in pos]          # decode the same positions again next repeat
        rows.append({"batch": b, "step_ms_p50": round(statistics.median(wall) * 1e3, 4),
                     "replay_ms_p50": round(statistics.median(dev) * 1e3, 4),
                     "tok_s": round(b / statistics.median(wall), 1)})
        print(f"[decode-step] ctx {context} B={b}: step {rows[-1]['step_ms_p50']} ms, replay "
              f"{rows[-1]['replay_ms_p50']} ms", file=sys.stderr, flush=True)
    info = {"context": context, "graph_width_pages": int(runner.graphs.pages.shape[1]), "rows": rows}
    del runner, pages
    gc.collect()
    torch.cuda.empty_cache()
    return info


def table(report: dict) -> str:
    base = {r["batch"]: r for r in report["settings"][0]["rows"]}
    return "\n".join(md_table(
        ["context", "graph table width (pages)", "batch", "step ms (p50)", "x first", "replay ms (p50)", "x first"],
        [[s["context"], s["graph_width_pages"], r["batch"], str(r["step_ms_p50"]),
          f"{r['step_ms_p50'] / base[r['batch']]['step_ms_p50']:.3f}", str(r["replay_ms_p50"]),
          f"{r['replay_ms_p50'] / base[r['batch']]['replay_ms_p50']:.3f}"]
         for s in report["settings"] for r in s["rows"]])) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/decode_step"))
    p.add_argument("--contexts", type=ints, default=[8192, 131072, 1048576])
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--page-size", type=int, default=256, help="SGLang's V4 pages (flash: a multiple of 128)")
    p.add_argument("--preset", default="flash")
    p.add_argument("--pool-tokens", type=int, help="the pool of every setting (default: the largest context)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA (the decode graphs)")
    contexts, batches = a.contexts, tuple(a.batches)
    a.pool_tokens = a.pool_tokens or max(contexts)
    report = {"preset": a.preset, "prompt_tokens": a.prompt_tokens, "steps": a.steps, "repeats": a.repeats,
              "pool_tokens": a.pool_tokens, "device": torch.cuda.get_device_name(), "versions": versions(), "settings": []}
    for ctx in contexts:
        report["settings"].append(measure(ctx, batches, a))
        write(a.out, report, md := table(report))   # what a timeout leaves is still reported
    print(md, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
