"""The plugin step's growth from 8K to 1M configured context in SGLang's own backend, two ways (subcommands of
`python -m bench.sglang_backend`):

    profile OUT.json [--batches ..]                 device time per kernel name, each context in turn
    paired OUTDIR [--contexts 8192,1048576] [--batches ..] [--ab-reps N]
                                                    both contexts' steps timed in the same rounds

Why `paired`: `mode plugin` times each context in its own stretch of the run (all 8K rows, then all 1M rows), so
whatever the machine drifts between them enters the 1M / 8K ratio; decode stock's own 1M / 8K read 0.92-1.16 on one
lease. Here one pool serves a rig per context (the pool does not depend on the configured context; the req-to-token
pool and the backend do), every (context, column) step is captured, and each round times one replay of each in
turn, so a round's 1M / 8K is taken minutes apart at most milliseconds. Per batch: each step's median and IQR, the
per-round ratio's median and IQR, and how far the contexts' eager outputs differ (the same rows and queries: only
the configured width differs, so they must agree).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import sglang_backend_rig as rig
from .common import versions


def _columns(r, fb, inputs) -> dict:
    """The step captured twice: as the plugin routes the decode (`plugin`) and with every decode call on SGLang's
    FlashMLA partial (`decode_stock`); name -> replay. The backend holds the routed call again afterwards."""
    routed, replays = r.backend._flash_mla_with_kvcache, {}
    try:
        for name, call in (("plugin", routed), ("decode_stock", routed.dsv4_stock)):
            r.backend._flash_mla_with_kvcache = call
            replays[name] = rig.capture(r, fb, inputs)[2]
    finally:
        r.backend._flash_mla_with_kvcache = routed
    return replays


def paired_rigs(contexts: list[int], max_reqs: int, tokens: int, device: str, layer_ids=None) -> dict:
    """A rig per configured context, all over the first one's pool (filled once)."""
    rigs: dict = {}
    for context in contexts:
        shared = next(iter(rigs.values())).pool if rigs else None
        rigs[context] = rig.build(context, max_reqs, tokens, "plugin", device, layer_ids, pool=shared)
        if shared is None:
            rig.fill(rigs[context])
    return rigs


def output_spread(outs: dict) -> float:
    """The largest relative difference of any layer's output from the first context's (eager steps)."""
    first, worst = next(iter(outs.values())), 0.0
    for other in list(outs.values())[1:]:
        for a, b in zip(other, first):
            worst = max(worst, ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item())
    return worst


def paired(out: Path, contexts: list[int], batches: list[int], live: int, reps: int) -> dict:
    import torch

    rig.prepare("plugin")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    max_reqs, tokens = rig.pool_shape(batches, live)
    rigs = paired_rigs(contexts, max_reqs, tokens, "cuda")
    for r in rigs.values():
        r.backend.init_cuda_graph_state(max(batches), max(batches))
    base, rows = contexts[0], []
    result = {"contexts": contexts, "live_tokens": live, "device": torch.cuda.get_device_name(), **versions(),
              "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    for b in batches:
        replays, outs = {}, {}
        for context, r in rigs.items():
            fb, inputs = rig.decode_batch(r, b, live), rig.layer_inputs(r, b)
            outs[context] = rig.eager_step(r, fb, inputs)
            replays.update({(context, name): replay for name, replay in _columns(r, fb, inputs).items()})
        row: dict = {"batch": b, "reps": reps, "output_spread": output_spread(outs)}
        times: dict = {k: [] for k in replays}
        for _ in range(reps):
            for k, replay in replays.items():
                times[k].append(rig._timed(replay, 1, flush))
        for (context, name), ts in times.items():
            spread = rig._spread(ts)
            row[f"{name}_{context}_ms"], row[f"{name}_{context}_iqr_ms"] = spread["median"], spread["iqr"]
            if context != base:
                spread = rig._spread([t / t0 for t, t0 in zip(ts, times[(base, name)])])
                row[f"{name}_{context}_over_{base}"] = spread["median"]
                row[f"{name}_{context}_over_{base}_iqr"] = spread["iqr"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        replays = outs = None
        (out / "paired.json").write_text(json.dumps(result, indent=1))  # what a timeout leaves is still reported
    lines = ["| B | column | " + " | ".join(f"{c} ms" for c in contexts) + " | per-round ratio (IQR) |",
             "|---|---|" + "---|" * len(contexts) + "---|"]
    for row in rows:
        for name in ("plugin", "decode_stock"):
            ratios = ", ".join(f"{row[f'{name}_{c}_over_{base}']:.3f} ({row[f'{name}_{c}_over_{base}_iqr']:.3f})"
                               for c in contexts[1:])
            lines.append(f"| {row['batch']} | {name} | " + " | ".join(
                f"{row[f'{name}_{c}_ms']:.3f} ± {row[f'{name}_{c}_iqr_ms']:.3f}" for c in contexts) + f" | {ratios} |")
    (out / "paired.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def profile(out: Path, batches: list[int], live: int, reps: int = 10) -> dict:
    """Where the plugin's step spends its device time (`profile`): per context (8K, 1M), batch and column (plugin,
    decode stock), the captured step warmed by 3 replays, then the torch profiler over `reps` replays: per kernel
    name its device time and launches a step, their sum (`busy_us`: it does not move with the host or with the
    machine's drift between rows, so its 1M / 8K is the growth the kernels cause) and the span (`span_us`)."""
    import gc

    import torch

    rig.prepare("plugin")
    max_reqs, tokens = rig.pool_shape(batches, live)
    res: dict = {}
    for context in (8192, 1048576):
        r = rig.build(context, max_reqs, tokens, "plugin", "cuda", None)
        rig.fill(r)
        r.backend.init_cuda_graph_state(max(batches), max(batches))
        for b in batches:
            fb, inputs = rig.decode_batch(r, b, live), rig.layer_inputs(r, b)
            rig.eager_step(r, fb, inputs)
            for name, replay in _columns(r, fb, inputs).items():
                for _ in range(3):
                    replay()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                    for _ in range(reps):
                        replay()
                    torch.cuda.synchronize()
                agg: dict = {}
                spans = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                for e in spans:
                    t, n = agg.get(e.name[:90], (0.0, 0))
                    agg[e.name[:90]] = (t + e.time_range.elapsed_us() / reps, n + 1)
                res[f"{context} {b} {name}"] = {
                    "kernels": {k: [round(t, 2), n // reps] for k, (t, n) in agg.items()},
                    "busy_us": round(sum(t for t, _ in agg.values()), 1),
                    "span_us": round((max(e.time_range.end for e in spans) - min(e.time_range.start for e in spans))
                                     / reps, 1) if spans else 0.0}
                print(context, b, name, res[f"{context} {b} {name}"]["busy_us"], flush=True)
            replay = fb = inputs = None
        del r
        gc.collect()
        torch.cuda.empty_cache()
    res["versions"] = versions()  # torch, Triton, the GPU: as every GPU results file records them
    out.write_text(json.dumps(res, indent=1))
    return res


