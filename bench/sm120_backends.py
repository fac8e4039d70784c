"""sm_120, 64 heads: the dispatch row's two kernels and the mma.sync kernel's options side by side, each against
SGLang's sm_120 Triton kernel on the same call (`SM120_SECTIONS=backends` of `bench/sm120_decode.py`, which writes
sm120_backends.json / .md)."""

from __future__ import annotations

import json
import os

from bench.common import md_columns
from bench.kernels import bench_us, graphed
from dsv4_cluster.kernels.sglang_adapters import flash_mla_with_kvcache
from dsv4_cluster.kernels.sglang_adapters.flash_mla_sm120 import flash_mla_keywords
from dsv4_cluster.kernels.sglang_cases import decode_case, sglang_sm120_args, sm120_call
from dsv4_cluster.kernels.sparse_mla_decode.config import LaunchConfig


def against_sglang(call: dict, ref, fields: dict) -> tuple[float, float, float]:
    """One config (LaunchConfig fields) on one call in the adapter's keywords: (max |diff| from `ref`, SGLang's
    output on the call; |ref|'s max; graph-replay us)."""
    cfg = LaunchConfig(**fields)
    out = flash_mla_with_kvcache(**call, config=cfg)[0].float()
    return ((out - ref).abs().max().item(), ref.abs().max().item(),
            bench_us(graphed(lambda: flash_mla_with_kvcache(**call, config=cfg)), 25, 100))


_MMA = dict(backend="gluon_mma_v2")
_PLAIN = dict(_MMA, fp8_words=False, lazy_rescale=False)  # neither option, whatever the row says
# "mma_v2" and its fixed split counts run the dispatch row's own options; the option columns set each one
BACKEND_CONFIGS = {"triton_row": dict(backend="triton"), "mma_v2": _MMA,
                   **{f"mma_v2_splits{n}": dict(_MMA, num_splits=n) for n in (1, 2, 4, 8)},
                   "mma_v2_plain": _PLAIN,
                   # fp8 dequantised four bytes at a time (690 loop instructions a warp against 781)
                   "mma_v2_words": dict(_PLAIN, fp8_words=True),
                   # O's rescale skipped unless a block's max passes the reference by more than 2**8 (ncu: 128 of
                   # the 821 instructions a warp spends on a block are that rescale)
                   "mma_v2_lazy": dict(_PLAIN, lazy_rescale=True),
                   "mma_v2_lazy_words": dict(_PLAIN, fp8_words=True, lazy_rescale=True),
                   # 16 warps: 4 a scheduler instead of 2 (the 8-warp kernel issues at 0.35 a cycle with 0.46 of
                   # its warps eligible), the S columns computed twice; 128 registers, 76-156 B spilled (sm_120a)
                   "mma_v2_warps16": dict(_PLAIN, num_warps=16),
                   "mma_v2_lazy_words_warps16": dict(_PLAIN, fp8_words=True, lazy_rescale=True, num_warps=16)}
# the options' columns of sm120_backends.md, in order
BACKEND_OPTIONS = [n for n in BACKEND_CONFIGS if n not in ("triton_row", "mma_v2") and "splits" not in n]


def backend_rows(base, c128_case, layers=(("c4", None),)) -> list[dict]:
    """64 heads, B = 1 ... 128: the sm_120 row's two kernels side by side, the Triton row (16-head programs) and the
    mma.sync Gluon kernel (automatic splits, then 1 / 2 / 4 / 8), each against SGLang's sm_120 Triton kernel on the
    same call: what `SPARSE_DECODE[("sm_120", 64)]` and its `min_batch` rest on. `SM120_BACKEND_LAYERS=c128` adds
    the ratio-128 layers (8K and 1M configured), built by `c128_case(B, configured, seed)`."""
    if "c128" in os.environ.get("SM120_BACKEND_LAYERS", ""):
        layers = (*layers, ("c128", 8192), ("c128", 1 << 20))
    rows = []
    for layer, ctx in layers:
        for b in (1, 8, 32, 64, 128):
            args = decode_case("c4", b, 64, seed=b, full=True) if layer == "c4" else c128_case(b, ctx, b)
            kw = sm120_call(args)
            pos = sglang_sm120_args(kw)
            ref = base.triton_decode(*pos)[0].float()
            call = flash_mla_keywords(kw, kw["q"], kw["attn_sink"])  # the sm_120 entry's own mapping
            theirs = bench_us(graphed(lambda: base.triton_decode(*pos)), 10, 50)
            for name, fields in BACKEND_CONFIGS.items():
                diff, ref_max, us = against_sglang(call, ref, fields)
                row = dict(layer=layer, configured=ctx, B=b, config=name, sglang_triton_graph_us=theirs,
                           max_abs_diff=diff, ref_max_abs=ref_max, graph_us=us)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def backends_markdown(result: dict) -> str:
    """One row per (layer, B): SGLang's sm_120 Triton kernel, the Triton row, the mma.sync Gluon kernel (automatic
    splits and the fastest fixed split count), graph replay, us."""
    v = result.get("versions") or {}
    table = []
    rows = result["backends"]
    for key in dict.fromkeys((r["layer"], r["configured"], r["B"]) for r in rows):
        group = {r["config"]: r for r in rows if (r["layer"], r["configured"], r["B"]) == key}
        fixed = min((r for n, r in group.items() if n.startswith("mma_v2_splits")), key=lambda r: r["graph_us"])
        opt = {n: f"{group[n]['graph_us']:.1f}" if n in group else "not run" for n in BACKEND_OPTIONS}
        table.append(dict(layer=key[0], configured=key[1], B=key[2],
                          sglang=group["triton_row"]["sglang_triton_graph_us"],
                          triton_row=group["triton_row"]["graph_us"], mma_v2=group["mma_v2"]["graph_us"],
                          fixed=f"{fixed['graph_us']:.1f} ({fixed['config'].removeprefix('mma_v2_splits')})",
                          **opt,
                          speedup=group["triton_row"]["graph_us"] / group["mma_v2"]["graph_us"],
                          vs_sglang=group["triton_row"]["sglang_triton_graph_us"] / group["mma_v2"]["graph_us"],
                          diff=max(r["max_abs_diff"] for r in group.values()),
                          ref=max(r["ref_max_abs"] for r in group.values())))
    return "\n".join([
        f"# sm_120, 64 heads: the Triton row against the mma.sync Gluon kernel ({result['device']} standing in, one "
        "run)", "",
        "`mma_v2` runs the dispatch row's own options (fp8 words and the lazy rescale since this run); each option "
        "column sets its options alone (`plain`: neither).", "",
        f"Device: {result['device']}, dispatch forced to {result['forced_class']}; torch {v.get('torch')}, Triton "
        f"{v.get('triton')}. CUDA-graph replay, cold L2, us per call, SGLang's sm_120 calling convention (q padded "
        "to 64 heads). `max diff`: the largest difference of any config's output from SGLang's sm_120 Triton kernel "
        "on the same call (`ref max`: that output's largest magnitude).", "",
        *md_columns(table, [("layer", "layer", ""), ("configured", "configured", ""), ("B", "B", ""),
                            ("SGLang Triton", "sglang", ".1f"), ("Triton row", "triton_row", ".1f"),
                            ("mma_v2 (auto splits)", "mma_v2", ".1f"), ("mma_v2 best fixed (splits)", "fixed", ""),
                            *((n.removeprefix("mma_v2_").replace("_", ", "), n, "") for n in BACKEND_OPTIONS),
                            ("Triton row / mma_v2", "speedup", ".2f"), ("SGLang Triton / mma_v2", "vs_sglang", ".1f"),
                            ("max diff", "diff", ".4f"), ("ref max", "ref", ".2f")])]) + "\n"
