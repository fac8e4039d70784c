"""`python -m bench.sglang_backend report OUTDIR`: the mode processes' JSON (bench/sglang_backend.py) -> the committed
bench/results/sglang_backend.{json,md}, with the equality of the saved outputs (stock vs plugin)."""

from __future__ import annotations

import json
from pathlib import Path

from .common import RESULTS, md_table, write

TOPK_SWAPS = 4  # of 512 per row (see compare)
EQ_CASE = {"context": 131072, "batch": 8, "live": 4096}  # 1,024 C4 entries: the top-512 is a real choice


def compare(out: Path) -> dict:
    """Stock vs plugin on the equality case: FlashMLA's tolerance per layer kind, top-k sets per row.

    The ratio-4 layer attends over each mode's own top-512. SGLang's torch indexer fallback scores in bf16, ours
    in fp32, so a row may select one entry either side of a tie at the 512th score (TOPK_SWAPS bounds them); such
    a row attends over a different set and its output differs by that entry's weight (4-5 % was seen). So the
    ratio-4 output is judged on the rows whose sets are equal, and the swapped rows are listed with their error.
    """
    import torch

    a, b = torch.load(out / "stock_outputs.pt"), torch.load(out / "plugin_outputs.pt")
    sets = [(set(x.tolist()) - {-1}, set(y.tolist()) - {-1}) for x, y in zip(a["topk"], b["topk"])]
    diff = [len(x - y) for x, y in sets]
    same = [i for i, d in enumerate(diff) if d == 0]
    result = {}
    for kind, ref in a["outputs"].items():
        got = b["outputs"][kind]
        rows = same if kind == "ratio4" else list(range(ref.shape[0]))
        err = ((got[rows] - ref[rows]).norm() / ref[rows].norm()).item() if rows else float("nan")
        result[kind] = {"rel_error": err, "max_abs": (got[rows] - ref[rows]).abs().max().item() if rows else None,
                        "rows": len(rows), "ok": bool(rows) and err < 0.01}
        if kind == "ratio4":
            result[kind]["swapped_rows"] = {
                str(i): round(((got[i] - ref[i]).norm() / ref[i].norm()).item(), 5) for i, d in enumerate(diff) if d}
    # At least half the rows must agree exactly: a systematic difference would swap many entries in every row.
    result["topk"] = {"rows": len(sets), "rows_equal": len(same), "max_swapped": max(diff),
                      "sizes": sorted({len(x) for x, _ in sets}),
                      "ok": max(diff) <= TOPK_SWAPS and 2 * len(same) >= len(sets)}
    return result


def _ratio(rows: dict, key: str, batch: int, contexts: list[int]):
    if len(contexts) < 2:
        return None  # one context measured: no ratio
    lo, hi = rows.get((contexts[0], batch), {}).get(key), rows.get((contexts[-1], batch), {}).get(key)
    return None if lo is None or hi is None else hi / lo


def report(out: Path) -> dict:
    stock, plugin = (json.loads((out / f"{m}.json").read_text()) if (out / f"{m}.json").exists()
                     else {"rows": [], "device": "-", "torch": "-", "layers": "-", "live_tokens": "-", "reps": "-"}
                     for m in ("stock", "plugin"))
    have = all((out / f"{m}_outputs.pt").exists() for m in ("stock", "plugin"))
    if have:
        eq = compare(out)
    elif not (out / "stock.json").exists():
        eq = {"not run": "stock mode was not run (MODES)"}
    else:
        eq = {"not run": "the equality case (context 131072) did not complete in both modes"}
    s = {(x["context"], x["batch"]): x for x in stock["rows"]}
    p = {(x["context"], x["batch"]): x for x in plugin["rows"]}
    contexts = sorted({c for c, _ in s} | {c for c, _ in p})
    if not contexts:
        raise SystemExit(f"sglang_backend report: no timed rows in {out}/stock.json or plugin.json (a mode process "
                         "that failed before its first row: its log says why)")
    batches = sorted({b for _, b in s} | {b for _, b in p})
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    run = stock if stock["rows"] else plugin  # device, versions and shape: from a mode that ran
    lines = ["# SGLang 0.5.23's DeepSeek-V4 decode attention backend: stock vs dsv4-cluster plugin", "",
             f"Device {run['device']}, torch {run['torch']}, Triton {run.get('triton', '-')}. One decode step of SGLang's "
             f"attention backend over {run['layers']} layers, TP4 (16 heads padded to 64), {run['live_tokens']} live "
             f"tokens per request; median of {run['reps']} steps, L2 flushed. ms per step. Modes run: "
             f"{', '.join(m for m, d in (('stock', stock), ('plugin', plugin)) if d['rows'])}.",
             "", "**stock** = SGLang 0.5.23 with FlashMLA (sgl-flash-mla 1.0.0) for decode, and SGLang's own "
             "fallbacks for what cannot load beside torch 2.11: indexer `fp8_paged_mqa_logits_torch` "
             "(SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1, DeepGEMM does not load) and top-k `topk_transform_pytorch_"
             "vectorized` (--dsa-topk-backend torch; the JIT top-k v2 needs tvm-ffi builds). **plugin** = SGLang's "
             "defaults plus our kernels installed by load_plugins() (sparse decode, indexer, top-k).", ""]
    graph = lambda x, y: fmt(y / x if x and y else None)  # noqa: E731
    iqr = lambda y, k: "-" if y.get(f"{k}_ms") is None else f"{y[f'{k}_ms']:.3f} ± {y[f'{k}_iqr_ms']:.3f}"  # noqa: E731
    lines += ["**decode stock** (plugin mode, the same process and pool) = the plugin's indexer and top-k with every "
              "decode call on SGLang's own FlashMLA partial; it and **plugin** are timed in interleaved rounds "
              "(`ab_reps`), median ± IQR. `plugin / decode stock` is the decode-only A/B.", ""]
    lines += md_table(["context", "batch", "stock graph", "decode stock graph", "plugin graph", "plugin / decode stock",
                       "plugin/stock", "stock eager", "decode stock eager", "plugin eager"],
                      [[c, b, fmt(x.get("graph_ms")), iqr(y, "decode_stock_graph"), iqr(y, "plugin_graph"),
                        graph(y.get("decode_stock_graph_ms"), y.get("plugin_graph_ms")),
                        graph(x.get("graph_ms"), y.get("graph_ms")), fmt(x.get("eager_ms")),
                        iqr(y, "decode_stock_eager"), iqr(y, "plugin_eager")]
                       for c in contexts for b in batches for x, y in [(s.get((c, b), {}), p.get((c, b), {}))]])
    ratios = [{"batch": b, **{f"{m}_{k}": _ratio(d, f"{k}_ms", b, contexts) for k in ("graph", "eager")
                              for m, d in (("stock", s), ("plugin", p))}} for b in batches]
    lines += ["", f"1M / 8K step-time ratio ({contexts[-1]} / {contexts[0]}):", "",
              *md_table(["batch", "stock graph", "plugin graph", "plugin graph 8K / 1M (median ± IQR, ms)",
                         "stock eager", "plugin eager"],
                        [[r["batch"], fmt(r["stock_graph"]), fmt(r["plugin_graph"]),
                          " / ".join(iqr(p.get((c, r["batch"]), {}), "plugin_graph") for c in (contexts[0], contexts[-1])),
                          fmt(r["stock_eager"]), fmt(r["plugin_eager"])] for r in ratios])]
    lines += ["", f"Equality (context {EQ_CASE['context']}, batch {EQ_CASE['batch']}, {EQ_CASE['live']} live tokens):",
              ""] + [f"- {k}: {json.dumps(v)}" for k, v in eq.items()]
    beside = (plugin.get("equality") or {}).get("flashmla_same_inputs")
    if beside:  # the plugin's own check: FlashMLA on the very arguments SGLang handed our kernel
        lines += ["", "Plugin mode, ours against FlashMLA on the same arguments (relative error per layer kind):", ""]
        lines += [f"- {kind}: {v['rel_error']:.2e}" for kind, v in beside.items()]
    errors = [f"- {m} {x['context']}/{x['batch']}: {x['graph_error']}" for m, d in (("stock", s), ("plugin", p))
              for x in d.values() if x.get("graph_error")]
    if errors:
        lines += ["", "Graph capture failures (eager only there):", ""] + errors
    result = {"stock": stock, "plugin": plugin, "equality": eq, "ratios_1m_8k": ratios}
    write(RESULTS / "sglang_backend", result, "\n".join(lines))
    print("\n".join(lines))
    return result
