"""sm_120 on an H200 stand-in: our kernels with the sm_120 dispatch forced vs SGLang 0.5.23's own sm_120 paths.

    DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1 python -m bench.kernels sm120_decode OUT_DIR

`SM120_SECTIONS=prefill_rows,decode,indexer` (the default) picks the tables; `sweep` times every launch config of
`SWEEP` for c4 at 64 heads (what the dispatch table's sm_120 rows should take); `backends` the 64-head row's two kernels
and the mma.sync kernel's options side by side (`bench/sm120_backends.py`) into sm120_backends.json / .md. Our kernels
run the dispatch table's sm_120 rows (tl.dot compiled to mma.sync as on sm_120), in SGLang's sm_120 calling
convention (q padded to 64 heads up to 64 rows, sliced to the real heads above), against SGLang's Triton
`flash_mla_sparse_decode_triton`, its PyTorch `_sm120_sparse_decode_fwd` and, for the indexer,
`fp8_paged_mqa_logits_torch_sm120`: CUDA-graph replay and eager, cold-L2 medians, us per call. SGLang's functions are
loaded unmodified from its source (`SGLANG_SRC`, default the installed sglang's): the Triton module whole; the PyTorch
ones, whose modules import SGLang's runtime (which does not load beside the H200's torch), by their source (`ast`).
FlashInfer's sm_120 kernel (SGLang's default there) is built
for sm_120 only: not measured.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import md_columns, versions, write
from bench.kernels import bench_us, graph_and_eager_us, graphed
from bench.sm120_backends import backend_rows, backends_markdown
from dsv4_cluster.kernels import dispatch
from dsv4_cluster.kernels.sglang_adapters import flash_mla_with_kvcache_sm120, fp8_paged_mqa_logits, topk_transform_paged_v2
from dsv4_cluster.kernels.sglang_cases import decode_case, indexer_case, sglang_sm120_args, sm120_call

LIVE = 2048


DECODE_CONSTANTS = ("_NOPE_DIM", "_ROPE_DIM", "_NOPE_ROPE_STRIDE", "_TILE_SIZE", "_NUM_TILES", "_SCALE_STRIDE", "_D")


def sglang_root() -> Path:
    if os.environ.get("SGLANG_SRC"):
        return Path(os.environ["SGLANG_SRC"])
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise RuntimeError("SGLang's source is needed: install sglang==0.5.23 or set SGLANG_SRC to its package folder")
    return Path(spec.origin).parent


def _functions(path: Path, names: tuple[str, ...], constants: tuple[str, ...], namespace: dict) -> dict:
    tree = ast.parse(path.read_text(), filename=str(path))
    picked = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in names) or
              (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in constants for t in n.targets))]
    missing = set(names) - {n.name for n in picked if isinstance(n, ast.FunctionDef)}
    if missing:
        raise RuntimeError(f"{path} no longer defines {', '.join(sorted(missing))}")
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def load() -> SimpleNamespace:
    """SGLang's sm_120 baselines: triton_decode, torch_decode, torch_indexer (their SGLang signatures)."""
    from typing import Any

    import torch.nn.functional as F

    root = sglang_root()
    ops = root / "kernels" / "ops" / "attention"
    spec = importlib.util.spec_from_file_location("sglang_sm120_triton", ops / "flash_mla_sm120_triton.py")
    triton_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(triton_mod)
    dec = _functions(ops / "flash_mla_sm120.py", ("_gather_and_dequant", "_sm120_sparse_decode_fwd"), DECODE_CONSTANTS,
                     {"torch": torch})
    idx = _functions(root / "srt" / "layers" / "attention" / "dsv4" / "indexer.py",
                     ("fp8_paged_mqa_logits_torch_sm120",), (),
                     {"torch": torch, "F": F, "Any": Any, "FP8_DTYPE": torch.float8_e4m3fn})
    return SimpleNamespace(triton_decode=triton_mod.flash_mla_sparse_decode_triton,
                           torch_decode=dec["_sm120_sparse_decode_fwd"],
                           torch_indexer=idx["fp8_paged_mqa_logits_torch_sm120"], root=str(root))


def _c128_case(b: int, ctx: int, seed: int) -> dict:
    width = max(512, ctx // 128)
    args = decode_case("c128", b, seed=seed, full=True, extra_tokens=max(8192, width))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((b, 1, width), -1, dtype=torch.int32)
    idx[:, :, :LIVE // 128] = torch.randint(0, max(8192, width), (b, 1, LIVE // 128), generator=gen, dtype=torch.int32)
    args["extra_indices_in_kvcache"] = idx.cuda()
    args["extra_topk_length"] = torch.full((b,), LIVE // 128, dtype=torch.int32, device="cuda")
    return args


def decode_rows(base) -> list[dict]:
    rows = []
    for layer, ctx in (("c4", None), ("c128", 8192), ("c128", 1 << 20)):
        for real in (16, 64):
            for b in (1, 8, 32, 64, 128):
                args = decode_case("c4", b, real, seed=b, full=True) if layer == "c4" else _c128_case(b, ctx, b)
                kw = sm120_call(args, real if b > 64 else None)
                pos = sglang_sm120_args(kw)
                ours = flash_mla_with_kvcache_sm120(**kw)[0]
                ref = base.triton_decode(*pos)[0]
                err = (ours.float() - ref.float()).abs().max().item()
                row = dict(layer=layer, configured=ctx, real_heads=real, heads=kw["q"].shape[2], B=b, max_abs_diff=err)
                for name, fn in (("ours", lambda: flash_mla_with_kvcache_sm120(**kw)),
                                 ("sglang_triton", lambda: base.triton_decode(*pos)),
                                 ("sglang_torch", lambda: base.torch_decode(*pos))):
                    try:
                        row[f"{name}_graph_us"], row[f"{name}_eager_us"] = graph_and_eager_us(fn)
                    except torch.OutOfMemoryError:
                        row[f"{name}_graph_us"] = row[f"{name}_eager_us"] = None
                        torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


PREFILL_ROWS = (1024, 4096, 16384)


def prefill_rows(base) -> list[dict]:
    """The prefill / extend rows SGLang sends the same sm_120 entry (its sparse prefill is off on sm_120): q sliced
    to the 16 real heads (TP4), one row per token with its window and top-512 (c4) lists; ours vs SGLang's Triton
    path, equality against its PyTorch path."""
    rows = []
    for rows_n in PREFILL_ROWS:
        kw = sm120_call(decode_case("c4", rows_n, 16, seed=rows_n, full=True), 16)
        pos = sglang_sm120_args(kw)
        row = dict(layer="c4", rows=rows_n, real_heads=16, max_abs_diff_vs_torch=None, torch_max_abs=None)
        if rows_n <= 4096:  # SGLang's PyTorch path gathers every row's lists in fp32: equality up to 4K rows
            ours = flash_mla_with_kvcache_sm120(**kw)[0].float()
            theirs = base.torch_decode(*pos)[0].float()
            row.update(max_abs_diff_vs_torch=(ours - theirs).abs().max().item(), torch_max_abs=theirs.abs().max().item())
            del ours, theirs
        for name, fn in (("ours", lambda: flash_mla_with_kvcache_sm120(**kw)),
                         ("sglang_triton", lambda: base.triton_decode(*pos))):
            row[f"{name}_graph_us"] = bench_us(graphed(fn), 25, 100)
        row["triton_over_ours"] = row["sglang_triton_graph_us"] / row["ours_graph_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return rows


SWEEP = dict(block_n=(16, 32, 64), head_group=(16, 32, 64), prefetch=(False, True), num_warps=(4, 8))


def sweep_rows(base) -> list[dict]:
    """c4 at 64 real heads, B = 1 ... 128: every LaunchConfig of SWEEP (block, heads per program, register
    prefetch, warps) through `flash_mla_with_kvcache` in the sm_120 call's arguments, graph replay, max diff
    against SGLang's sm_120 Triton kernel: which config the dispatch table's sm_120 rows should take next
    (`SPARSE_DECODE[("sm_120", 64)]`; the CI test then checks it against 99 KB and for spills as compiled for sm_120)."""
    import itertools

    from dsv4_cluster.kernels.sglang_adapters import flash_mla_with_kvcache
    from dsv4_cluster.kernels.sglang_adapters.flash_mla_sm120 import flash_mla_keywords
    from dsv4_cluster.kernels.sparse_mla_decode.config import LaunchConfig

    rows = []
    for b in (1, 8, 32, 64, 128):
        kw = sm120_call(decode_case("c4", b, 64, seed=b, full=True))
        ref = base.triton_decode(*sglang_sm120_args(kw))[0].float()
        call = flash_mla_keywords(kw, kw["q"], kw["attn_sink"])   # the sm_120 entry's own mapping
        for bn, hg, pf, nw in itertools.product(*SWEEP.values()):
            cfg = LaunchConfig(backend="triton", block_n=bn, num_stages=1, head_group=hg, prefetch=pf, num_warps=nw)
            row = dict(B=b, block_n=bn, head_group=hg, prefetch=pf, num_warps=nw)
            try:
                out = flash_mla_with_kvcache(**call, config=cfg)[0].float()
                row["max_abs_diff"] = (out - ref).abs().max().item()
                row["graph_us"] = bench_us(graphed(lambda: flash_mla_with_kvcache(**call, config=cfg)), 25, 100)
            except Exception as exc:  # a config that does not compile or launch here: recorded, the sweep goes on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def indexer_rows(base) -> list[dict]:
    rows = []
    for ctx in (8192, 128 * 1024, 1 << 20):
        cap = ctx // 4
        for b in (1, 8, 32):
            c = indexer_case(b, [LIVE // 4] * b, capacity=cap, seed=b)
            out = torch.empty(b, 512, dtype=torch.int32, device="cuda")
            raw = torch.empty_like(out)

            def ours():
                logits = fp8_paged_mqa_logits(c["q"], c["kv"], c["weights"], c["lens2d"], c["table"], None, cap, False)
                topk_transform_paged_v2(logits, c["lens"], c["table"], out, 64, None, raw)

            def theirs():
                return base.torch_indexer(c["q"], c["kv"], c["weights"], c["lens"], c["table"], None, cap, False)

            row = dict(configured=ctx, live=LIVE, B=b)
            for name, fn in (("ours_indexer_topk", ours), ("sglang_torch_indexer", theirs)):
                row[f"{name}_graph_us"], row[f"{name}_eager_us"] = graph_and_eager_us(fn)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".")
    gpu = dispatch.class_of_device(torch.device("cuda"))
    if gpu != "sm_120":
        raise SystemExit(f"run with {dispatch.CLASS_ENV}=sm_120 {dispatch.MMA_V2_ENV}=1 (this run is {gpu})")
    base = load()
    result = {"device": torch.cuda.get_device_name(), "forced_class": gpu, "sglang_src": base.root,
              "flashinfer_sm120": "not run: FlashInfer's sm_120 CUDA kernel cannot run on a Hopper stand-in"}
    sections = {"prefill_rows": prefill_rows, "decode": decode_rows, "indexer": indexer_rows, "sweep": sweep_rows,
                "backends": lambda base: backend_rows(base, _c128_case)}
    # the sweep (36 configs x 5 batches) runs when asked: SM120_SECTIONS=sweep; the two kernels of the 64-head row side
    # by side (SM120_SECTIONS=backends) go to their own files, sm120_backends.json / .md
    default = "prefill_rows,decode,indexer"
    names = os.environ.get("SM120_SECTIONS", default).split(",")
    for name in names:
        result[name] = sections[name](base)
    result["versions"] = versions()
    out.mkdir(parents=True, exist_ok=True)
    if "backends" in names:
        write(out / "sm120_backends", {k: v for k, v in result.items() if k not in set(names) - {"backends"}},
              backends_markdown(result))
    if set(names) - {"backends"}:
        write(out / "sm120_decode", {k: v for k, v in result.items() if k != "backends"}, markdown(result))
    return 0


RTX_PRO_6000_GBPS = 1790  # GDDR7, datasheet: the floor column of the table


def live_rows(r: dict) -> int:
    """Rows a decode call must read per query: the 128-row window plus 512 (c4) or 2K / 128 live entries (c128)."""
    return 128 + (512 if r["layer"] == "c4" else LIVE // 128)


def markdown(result: dict) -> str:
    """The decode and indexer tables, with the RTX PRO 6000 floor (bytes / 1.79 TB/s) beside each decode row."""
    v, us = result.get("versions") or {}, lambda head, key: (head, key, ".0f")  # noqa: E731
    ratio = lambda r: r["sglang_triton_graph_us"] / r["ours_graph_us"]  # noqa: E731
    decode = [dict(r, ratio=ratio(r), floor=r["B"] * live_rows(r) * 584 / (RTX_PRO_6000_GBPS * 1e3))
              for r in result.get("decode", [])]
    prefill = [dict(r, floor=r["rows"] * 640 * 584 / (RTX_PRO_6000_GBPS * 1e3)) for r in result.get("prefill_rows", [])]
    sweep = [r for r in result.get("sweep", []) if "graph_us" in r]
    fastest = [r for b in sorted({r["B"] for r in sweep})
               for r in sorted((r for r in sweep if r["B"] == b), key=lambda r: r["graph_us"])[:3]]
    return "\n".join([
        f"# sm_120 on a Hopper stand-in ({result['device']}; bench/sm120_decode.py, one run)", "",
        f"Device: {result['device']}, dispatch forced to {result['forced_class']} (mma.sync, the 99 KB configs); "
        f"torch {v.get('torch')}, Triton {v.get('triton')}. {result['flashinfer_sm120']}.", "",
        *([f"{result['earlier']['note']}", ""] if result.get("earlier") else []),
        "What the stand-in cannot show: sm_120's occupancy (188 SMs of 99 KB; an H100 / H200 has 132 of 227 KB), "
        "GDDR7's latency and 1.79 TB/s (HBM3 / HBM3e read at ~3.3 / ~4.3 TB/s). `floor`: the call's bytes (live rows x "
        "584 B) over 1.79 TB/s, the RTX PRO 6000's bound. Microseconds, CUDA-graph replay (and eager).", "",
        *md_columns(decode, [("layer", "layer", ""), ("configured", "configured", ""), ("real heads", "real_heads", ""),
                             ("heads computed", "heads", ""), ("B", "B", ""), us("ours", "ours_graph_us"),
                             us("ours eager", "ours_eager_us"), us("SGLang Triton", "sglang_triton_graph_us"),
                             us("SGLang torch", "sglang_torch_graph_us"), ("Triton / ours", "ratio", ".1f"),
                             ("floor (RTX PRO 6000)", "floor", ".1f"), ("max diff", "max_abs_diff", ".4f")]),
        "", "Prefill / extend rows (c4, 16 real heads, q sliced as SGLang does above 64 rows), graph replay, us:", "",
        *md_columns(prefill, [("rows", "rows", ""), us("ours", "ours_graph_us"),
                              us("SGLang Triton", "sglang_triton_graph_us"), ("Triton / ours", "triton_over_ours", ".1f"),
                              ("floor (RTX PRO 6000)", "floor", ".0f"),
                              ("max diff vs SGLang torch", "max_abs_diff_vs_torch", ".4f"),
                              ("SGLang torch max", "torch_max_abs", ".2f")]),
        *(["", "Launch-config sweep, c4, 64 heads: the fastest three per B (graph, us):", "", *md_columns(fastest, [
            ("B", "B", ""), ("block", "block_n", ""), ("heads / program", "head_group", ""), ("prefetch", "prefetch", ""),
            ("warps", "num_warps", ""), us("us", "graph_us"), ("max diff vs SGLang Triton", "max_abs_diff", ".4f")])]
          if fastest else []), "",
        *md_columns(result.get("indexer", []), [
            ("indexer: configured", "configured", ""), ("live", "live", ""), ("B", "B", ""),
            ("ours (indexer + top-k)", "ours_indexer_topk_graph_us", ".1f"),
            ("SGLang torch indexer", "sglang_torch_indexer_graph_us", ".1f")])]) + "\n"
