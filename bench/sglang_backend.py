"""SGLang 0.5.23's own DeepSeek-V4 decode attention backend on the H200: stock vs our plugin, one mode per process.

    python -m bench.sglang_backend mode stock|plugin OUTDIR [--contexts ..] [--batches ..] [--live N]
    python -m bench.sglang_backend report OUTDIR      # -> bench/results/sglang_backend.{json,md}
    python -m bench.sglang_backend profile OUT.json [--batches ..]   # device time per kernel, 8K and 1M
    python -m bench.sglang_backend paired OUTDIR [--contexts 8192,1048576] [--batches ..] [--ab-reps N]

A mode process stands SGLang's backend up (`sglang_backend_rig.py`: what is SGLang's, what stands in and why, how
the modes differ), then per configured context and batch (each request `live` tokens) times one decode step of the
backend over DeepSeek-V4-Flash's 43 layers, TP4 (16 real heads padded to 64): SGLang's decode metadata + per layer
forward_c4_indexer (ratio 4) + forward. Eager, and as SGLang's decode runner captures and replays CUDA graphs
(init_cuda_graph_state, out-of-graph metadata in_capture, two warm-ups, on_after_cuda_graph_warmup, capture of the
in-graph metadata + layers; a replay step = init_forward_metadata_out_graph + replay). L2 flushed before every
timed step; median of `reps`. Plugin mode times, instead, the decode-only A/B: the plugin's step and the same step
with every decode call on SGLang's FlashMLA partial (indexer and top-k ours in both), `--ab-reps` interleaved
rounds, median and IQR of each (`_decode_ab`). One equality case's outputs are saved; `report`
(`sglang_backend_report.py`) compares stock and plugin.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from . import sglang_backend_rig as rig
from .common import ints, versions
from .sglang_backend_report import EQ_CASE, report
from .sglang_backend_rig import _spread, _timed, capture, eager_step, pool_shape


KIND_LAYERS = (0, 2, 3)  # V4-Flash's first window-only, ratio-4 and ratio-128 layers


def _decode_ab(r: rig.Rig, fb, inputs, reps: int, flush) -> dict:
    """Plugin mode: the step as the plugin runs it (`plugin`: the route table's decode, our indexer / top-k) against
    the same step with every decode call on SGLang's own FlashMLA partial (`decode_stock`, the indexer and top-k
    still ours), in one process on one pool: both graphs captured, then `reps` rounds, each timing one eager step
    and one replay of each (L2 flushed before each), interleaved. Median and IQR of each."""
    backend = r.backend
    routed = backend._flash_mla_with_kvcache
    variants = {"plugin": routed, "decode_stock": routed.dsv4_stock}
    replays, row = {}, {"ab_reps": reps}
    for name, call in variants.items():
        backend._flash_mla_with_kvcache = call
        try:
            replays[name] = capture(r, fb, inputs)[2]
        except Exception as e:  # reported in the table, never hidden
            row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:300]
    times: dict[str, list[float]] = {}
    try:
        for _ in range(reps):
            for name, call in variants.items():
                backend._flash_mla_with_kvcache = call
                times.setdefault(f"{name}_eager", []).append(_timed(lambda: eager_step(r, fb, inputs), 1, flush))
                if name in replays:
                    times.setdefault(f"{name}_graph", []).append(_timed(replays[name], 1, flush))
    finally:
        backend._flash_mla_with_kvcache = routed
    for key, values in times.items():
        spread = _spread(values)
        row[f"{key}_ms"], row[f"{key}_iqr_ms"] = spread["median"], spread["iqr"]
    row.update(eager_ms=row["plugin_eager_ms"], graph_ms=row.get("plugin_graph_ms"),
               graph_error=row.get("plugin_graph_error"))
    return row


def run_mode(mode: str, out: Path, contexts: list[int], batches: list[int], live: int, reps: int,
             layer_ids: list[int] | None = None, ab_reps: int = 20) -> dict:
    factory = rig.prepare(mode)
    import torch

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows, eq = _earlier(out / f"{mode}.json", contexts)
    max_reqs, tokens_per_req = pool_shape(batches, live)
    for context in contexts:
        t0 = time.time()
        r = rig.build(context, max_reqs, tokens_per_req, mode, "cuda", layer_ids)
        rig.fill(r)
        r.backend.init_cuda_graph_state(max(batches), max(batches))
        if context == EQ_CASE["context"]:
            eq = _equality_case(r, out / f"{mode}_outputs.pt", mode)
        for batch in batches:
            fb, inputs = rig.decode_batch(r, batch, live), rig.layer_inputs(r, batch)
            eager_step(r, fb, inputs)
            torch.cuda.synchronize()
            if mode == "plugin":
                row = _decode_ab(r, fb, inputs, ab_reps, flush)
            else:
                row = {"eager_ms": _timed(lambda: eager_step(r, fb, inputs), reps, flush)}
                try:
                    replay = capture(r, fb, inputs)[2]
                    row.update(graph_ms=_timed(replay, reps, flush), graph_error=None)
                except Exception as e:  # reported in the table, never hidden
                    row.update(graph_ms=None, graph_error=f"{type(e).__name__}: {e}"[:300])
            rows.append({"context": context, "batch": batch, **row})
            print(json.dumps({"mode": mode, **rows[-1]}), flush=True)
            _write(mode, out, factory, live, reps, layer_ids, eq, rows)  # what a timeout leaves is still reported
            replay = fb = inputs = None  # the replay closure holds the backend, hence the whole pool
        print(f"context {context}: {time.time() - t0:.1f} s", flush=True)
        del r
        gc.collect()  # the next context's pool must not meet this one's (the first device run ran out of memory)
        torch.cuda.empty_cache()
    return _write(mode, out, factory, live, reps, layer_ids, eq, rows)


def _earlier(path: Path, contexts: list[int]) -> tuple[list, dict | None]:
    """Rows (other contexts) and equality case an earlier process of this mode wrote to `path`."""
    if not path.exists():
        return [], None
    old = json.loads(path.read_text())
    return [x for x in old["rows"] if x["context"] not in contexts], old.get("equality")


def _write(mode, out, factory, live, reps, layer_ids, eq, rows) -> dict:
    import torch

    result = {"mode": mode, "dsv4_factory": factory, "env": rig.MODE_ENV[mode], "topk_backend": rig.TOPK_BACKEND[mode],
              "live_tokens": live, "reps": reps,
              "layers": "43 (2 window, 21 ratio-4, 20 ratio-128)" if layer_ids is None else f"ids {layer_ids}",
              "device": torch.cuda.get_device_name(), **versions(), "equality": eq, "rows": rows}
    (out / f"{mode}.json").write_text(json.dumps(result, indent=1))
    return result


def _equality_case(r: rig.Rig, path: Path, mode: str) -> dict:
    """One window, one ratio-4 and one ratio-128 layer's outputs and the ratio-4 top-k, saved for `report`.
    In plugin mode on CUDA also FlashMLA itself on the very arguments SGLang handed our kernel, per layer
    (`_beside_flashmla`): equality that no top-k tie can touch."""
    import torch

    fb = rig.decode_batch(r, EQ_CASE["batch"], EQ_CASE["live"])
    inputs = rig.layer_inputs(r, EQ_CASE["batch"], seed=7)
    keep: list = []
    same_inputs = None
    if mode == "plugin" and torch.cuda.is_available():
        outs, same_inputs = _beside_flashmla(r, lambda: eager_step(r, fb, inputs, keep))
    else:
        outs = eager_step(r, fb, inputs, keep)
    kinds = {}
    for (layer, ratio), o in zip(r.layers, outs):
        kinds.setdefault({0: "window", 4: "ratio4", 128: "ratio128"}[ratio], o.float().cpu())
    torch.save({"outputs": kinds, "topk": keep[0].cpu()}, path)
    return {**EQ_CASE, "saved": path.name, **({"flashmla_same_inputs": same_inputs} if same_inputs else {})}


def _beside_flashmla(r: rig.Rig, step) -> tuple[list, dict]:
    """Runs `step` with the backend's decode call wrapped: our kernel (the plugin's adapter, on every call whatever
    the route table would pick), then SGLang's
    own FlashMLA partial (`flash_mla_interface.flash_mla_with_kvcache`, the plugin's keywords) on the same
    arguments; per layer kind the relative error of ours against FlashMLA over the 16 real heads, every row."""
    import functools

    from sglang.kernels.ops.attention import flash_mla_interface

    backend = r.backend
    routed = backend._flash_mla_with_kvcache  # the plugin's routed call: ours or SGLang's partial per the route table
    keywords = routed.dsv4_stock.keywords
    ours = functools.partial(routed.dsv4_adapter, **keywords)  # our kernel on every call, whatever the route
    stock = functools.partial(flash_mla_interface.flash_mla_with_kvcache, **keywords)
    pairs: list = []

    def both(*args, **kwargs):
        got = ours(*args, **kwargs)
        try:
            pairs.append((got, stock(*args, **kwargs)))
        except Exception as e:  # reported in the JSON, never hidden
            pairs.append((got, f"{type(e).__name__}: {e}"[:300]))
        return got

    backend._flash_mla_with_kvcache = both
    try:
        outs = step()
    finally:
        backend._flash_mla_with_kvcache = routed
    first = lambda x: x[0] if isinstance(x, tuple) else x  # noqa: E731  (out, lse)
    if len(pairs) != len(r.layers):
        return outs, {"error": f"{len(pairs)} decode calls for {len(r.layers)} layers: not one per layer"}
    result = {}
    for ((_, ratio), (got, ref)) in zip(r.layers, pairs):
        kind = {0: "window", 4: "ratio4", 128: "ratio128"}[ratio]
        if isinstance(ref, str):
            result.setdefault(kind, {"error": ref})
            continue
        a, b = first(got)[..., : rig.REAL_HEADS, :].float(), first(ref)[..., : rig.REAL_HEADS, :].float()
        result.setdefault(kind, {"rel_error": ((a - b).norm() / b.norm()).item(), "shape": list(first(got).shape)})
    return outs, result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sglang_backend")
    ap.add_argument("what", choices=["mode", "report", "profile", "paired"])
    ap.add_argument("args", nargs="+")
    ap.add_argument("--contexts", type=ints, default=[8192, 131072, 1048576])
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128])
    ap.add_argument("--live", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ab-reps", type=int, default=20,
                    help="plugin mode: interleaved rounds of the plugin step and the decode-stock step")
    ap.add_argument("--layer-ids", type=ints, default=None, help="comma-separated layer ids (default: all 43)")
    ap.add_argument("--then-each-kind", action="store_true",
                    help="after the run, one per layer kind (ids 0 window, 2 ratio 4, 3 ratio 128) in this process, "
                         "into OUT/kind_<id>/: where the step's time goes, without a fresh import per kind")
    a = ap.parse_args(argv)
    if a.what == "report":
        report(Path(a.args[0]))
        return 0
    if a.what in ("profile", "paired"):  # the step's growth from 8K to 1M (sglang_backend_growth.py)
        from . import sglang_backend_growth as growth

        if a.what == "profile":
            growth.profile(Path(a.args[0]), a.batches, a.live)
        else:
            growth.paired(Path(a.args[0]), a.contexts, a.batches, a.live, a.ab_reps)
        return 0
    mode, out = a.args
    Path(out).mkdir(parents=True, exist_ok=True)
    run_mode(mode, Path(out), a.contexts, a.batches, a.live, a.reps, a.layer_ids, a.ab_reps)
    for layer in (KIND_LAYERS if a.then_each_kind else ()):
        (Path(out) / f"kind_{layer}").mkdir(exist_ok=True)
        run_mode(mode, Path(out) / f"kind_{layer}", a.contexts, a.batches, a.live, a.reps, [layer], a.ab_reps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
