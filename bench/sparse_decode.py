"""Benchmark of sparse MLA decode on one GPU: `python -m bench.kernels sparse_decode`.

DeepSeek-V4 CSA-layer shapes: 64 heads, D = 512, a 128-row window + top-512 compressed entries per
query, every query over its own region of a large cache (so rows come from HBM, not L2). Reported
per batch size: median time (cold L2), effective GB/s over the bytes the op needs (selected rows +
Q + O + lse + indices), that as a fraction of the device copy bandwidth measured in the same run,
TFLOP/s; for the Triton kernel (bf16 rows and the V4 fp8 layout), the PyTorch reference and
FlashMLA's SM90 sparse decode on the same fp8 cache (if `flash_mla` loads; otherwise its error).
A kernel whose output disagrees with the reference gets no row but its error.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import traceback

import torch
from triton.runtime.errors import OutOfResources

from bench.kernels import bench_us, copy_bandwidth_gbs, print_table, write_results
from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout, quantize_kv_v4, sparse_mla_decode_ref
from dsv4_cluster.kernels.sparse_mla_decode.reference import attend, gather_rows
from dsv4_cluster.kernels.sparse_mla_decode.splits import choose_splits, fuses_merge, gluon_splits
from dsv4_cluster.kernels.sparse_mla_decode.launch import (
    LaunchConfig,
    gluon_unavailable,
    gluon_smem_bytes,
    resolved,
    SMEM_LIMIT,
    sparse_mla_decode_fp8_triton,
    sparse_mla_decode_triton,
)

H, D, W, TOPK = 64, 512, 128, 512
CONTEXT = 4096  # tokens per request: main-cache region; L/4 compressed entries in the extra cache
MAX_REL_ERR = 2e-2


def make_inputs(b: int, seed: int = 0) -> dict:
    """Per request: window = its last 128 tokens, extra = 512 distinct of its L/4 compressed entries."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    comp = CONTEXT // 4
    q = torch.randn(b, H, D, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(b * CONTEXT, D, device="cuda", generator=g).to(torch.bfloat16)
    extra = torch.randn(b * comp, D, device="cuda", generator=g).to(torch.bfloat16)
    base = torch.arange(b, device="cuda")[:, None]
    widx = (base * CONTEXT + CONTEXT - W + torch.arange(W, device="cuda")[None, :]).int()
    picks = torch.rand(b, comp, device="cuda", generator=g).argsort(dim=1)[:, :TOPK].sort(dim=1).values
    eidx = (base * comp + picks).int()
    sink = torch.randn(H, device="cuda", generator=g)
    return dict(q=q, kv=kv, window_idx=widx, extra_kv=extra, extra_idx=eidx, sink=sink)


def inputs_and_references(b: int):
    """`make_inputs(b, seed=b)`, its rows quantised to V4 fp8 caches, the case without its bf16 rows (for the
    fp8 calls), and the reference outputs on the bf16 rows and on the dequantised fp8 rows."""
    case = make_inputs(b, seed=b)
    cache, extra_cache = quantize_kv_v4(case["kv"]), quantize_kv_v4(case["extra_kv"])
    fp8_case = {k: v for k, v in case.items() if k not in ("kv", "extra_kv")}
    ref_out, _ = sparse_mla_decode_ref(**case)
    deq = {**case, "kv": fp8_layout.dequantize_kv_v4(cache), "extra_kv": fp8_layout.dequantize_kv_v4(extra_cache)}
    ref8_out, _ = sparse_mla_decode_ref(**deq)
    return case, cache, extra_cache, fp8_case, ref_out, ref8_out


def torch_reference(case: dict):
    """The reference's math (gather, then attention) without its host-syncing index checks."""
    rows, valid = gather_rows(case["kv"], case["window_idx"], case["extra_kv"], case["extra_idx"])
    return attend(case["q"], rows, valid, case["sink"], D**-0.5)


def required_bytes(b: int, row_bytes: int) -> int:
    per_query = (W + TOPK) * (row_bytes + 4) + 2 * H * D * 2 + H * 4
    return b * per_query


def flops(b: int) -> float:
    return 2.0 * 2.0 * b * H * (W + TOPK) * D


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def flashmla_call(case: dict, cache: torch.Tensor, extra_cache: torch.Tensor):
    """A closure running FlashMLA's SM90 V4 sparse decode on our fp8 caches, or the import error."""
    try:
        import flash_mla
    except (ImportError, OSError, RuntimeError) as exc:  # a load failure (ABI, missing lib) is the result
        return None, f"{type(exc).__name__}: {exc}"
    b = case["q"].shape[0]
    q4 = case["q"].view(b, 1, H, D)
    widx, eidx = case["window_idx"].view(b, 1, W), case["extra_idx"].view(b, 1, TOPK)
    wlen = torch.full((b,), W, dtype=torch.int32, device="cuda")
    elen = torch.full((b,), TOPK, dtype=torch.int32, device="cuda")
    k_view, e_view = fp8_layout.flashmla_view(cache), fp8_layout.flashmla_view(extra_cache)
    meta = flash_mla.get_mla_metadata()[0]

    def run():
        out, lse = flash_mla.flash_mla_with_kvcache(
            q4, k_view, None, None, D, meta, softmax_scale=D**-0.5, is_fp8_kvcache=True,
            indices=widx, attn_sink=case["sink"], extra_k_cache=e_view, extra_indices_in_kvcache=eidx,
            topk_length=wlen, extra_topk_length=elen, use_legacy=True, kv_format="V4",
        )
        return out.view(b, H, D), lse

    return run, None


def graphed(fn):
    """`fn` captured in a CUDA graph (after one eager call that compiles / initialises): its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(name, fn, ref_out, b, row_bytes, copy_gbs, extra=None):
    """Time of one CUDA-graph replay of `fn` (how decode runs), and of an eager call (adds Python launch cost)."""
    err = rel_err(fn()[0], ref_out)
    row = dict(kernel=name, B=b, rel_err=err, **(extra or {}))
    if not err < MAX_REL_ERR:
        row["error"] = f"output disagrees with the reference (relative error {err:.3g}); not timed"
        return row
    row["us_eager"] = bench_us(fn)
    try:
        us = bench_us(graphed(fn))
    except RuntimeError as exc:
        row["error"] = f"CUDA-graph capture failed ({type(exc).__name__}: {exc}); us is eager"
        us = row["us_eager"]
    gbs = required_bytes(b, row_bytes) / (us * 1e-6) / 1e9
    row.update(us=us, GBps=gbs, frac_copy=gbs / copy_gbs, TFLOPs=flops(b) / (us * 1e-6) / 1e12)
    print(f"  {name:22s} B={b:4d} {us:8.1f} us (eager {row['us_eager']:7.1f}) {gbs:7.0f} GB/s {gbs / copy_gbs:5.1%} of copy  err {err:.2e} {extra or ''}")
    return row


def best_config(fn_for, ref_out, b, configs):
    """Fastest correct config for this batch size (each timed once)."""
    best = None
    for cfg in configs:
        fn = fn_for(cfg)
        try:
            if rel_err(fn()[0], ref_out) >= MAX_REL_ERR:
                print(f"  {cfg}: wrong output, skipped")
                continue
            us = bench_us(graphed(fn), rep_ms=100)
        except (RuntimeError, OutOfResources, ValueError) as exc:  # e.g. too much shared memory for this config
            print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}, skipped")
            continue
        print(f"  {us:8.1f} us  {cfg}")
        if best is None or us < best[1]:
            best = (cfg, us)
    return best[0] if best else None


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the main kernel (Triton's cache)."""
    from dsv4_cluster.kernels.sparse_mla_decode import kernel

    found = []
    try:
        for entry in kernel._sparse_decode_kernel.device_caches.values():
            for compiled in entry[0].values():
                compiled._init_handles()
                meta = compiled.metadata
                found.append(dict(regs=compiled.n_regs, spills=compiled.n_spills, smem=meta.shared,
                                  warps=meta.num_warps, stages=meta.num_stages,
                                  async_copies=compiled.asm["ttgir"].count("async_copy_global_to_local"),
                                  wgmma=compiled.asm["ttgir"].count("warp_group_dot ")))
    except (AttributeError, KeyError, IndexError, TypeError) as exc:  # Triton's cache layout is internal
        found.append(dict(error=f"{type(exc).__name__}: {exc}"))
    return found


def profile(batches: list[int]) -> int:
    """Three calls of each Triton kernel per batch size, default config, nothing timed: a target for ncu."""
    for b in batches:
        case = make_inputs(b, seed=b)
        cache, extra_cache = quantize_kv_v4(case["kv"]), quantize_kv_v4(case["extra_kv"])
        fp8_case = {k: v for k, v in case.items() if k not in ("kv", "extra_kv")}
        for _ in range(3):
            sparse_mla_decode_triton(**case)
            sparse_mla_decode_fp8_triton(**fp8_case, kv_cache=cache, extra_cache=extra_cache)
    torch.cuda.synchronize()
    return 0


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sparse_decode")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--sweep", nargs="?", const="all", choices=["all", "gluon"],
                        help="also try other launch configs (all kernels, or the Gluon ones), report the best")
    parser.add_argument("--profile", action="store_true", help="only run the Triton kernels a few times (for ncu)")
    parser.add_argument("--blocks", help="Gluon sweep: block_n:stages pairs to try, e.g. 64:2,32:4 (default: all that fit)")
    parser.add_argument("--splits", help="Gluon sweep: split counts to try at every B, e.g. 2,5,10 (default: "
                        "choose_splits' picks with and without the fused merge, and the neighbours that won before)")
    parser.add_argument("--merge", choices=["fused", "kernel", "both"], default="both",
                        help="Gluon sweep: split merges to try (fused into the kernel where the CTAs fit, the merge kernel)")
    parser.add_argument("--kernels", default="torch_reference_bf16,triton_bf16,triton_fp8,gluon_bf16,gluon_fp8,flashmla_fp8_v4",
                        help="comma-separated rows to measure")
    args = parser.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if args.profile:
        return profile(batches)
    copy_gbs = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, fm_error = [], None
    for b in batches:
        case, cache, extra_cache, fp8_case, ref_out, ref8_out = inputs_and_references(b)
        wanted = set(args.kernels.split(","))
        if "torch_reference_bf16" in wanted:
            rows.append(measure("torch_reference_bf16", lambda: torch_reference(case), ref_out, b, 1024, copy_gbs))

        nblocks = {bn: -(-W // bn) + -(-TOPK // bn) for bn in (16, 32, 64)}
        triton_default = LaunchConfig(backend="triton")
        gluon_default = LaunchConfig(backend="gluon")
        configs = {"triton_bf16": [triton_default], "triton_fp8": [triton_default],
                   "gluon_bf16": [gluon_default], "gluon_fp8": [gluon_default]}
        if args.sweep:
            base = [LaunchConfig(block_n=bn, num_stages=st, num_splits=s, backend="triton")
                    for bn, st in itertools.product((32, 64), (2, 3))
                    for s in sorted({choose_splits(b, nblocks[bn], sms), choose_splits(b, nblocks[bn], 2 * sms)})]
            if args.sweep == "all":
                configs["triton_bf16"] = base
                configs["triton_fp8"] = base + [dataclasses.replace(c, prefetch=True) for c in base]
            # (block_n, stages) for both row formats: fp8 rows are dequantised from registers into the
            # same bf16 stages, so the kernel's shared memory does not depend on the format
            blocks = [tuple(map(int, x.split(":"))) for x in args.blocks.split(",")] if args.blocks else \
                [(64, 2), (32, 4), (32, 3)]
            merges = {"fused": (True,), "kernel": (False,), "both": (True, False)}[args.merge]

            def split_counts(bn):
                if args.splits:
                    return sorted({1, *(int(x) for x in args.splits.split(","))})
                return sorted({1, choose_splits(b, nblocks[bn], sms), choose_splits(b, nblocks[bn], sms, fused=True),
                               *((5, 10, 16) if b <= 8 else ()), *((2, 4) if b <= 32 else (2,))})

            # a fused merge needs every CTA resident at once (B x splits <= SMs); one split has no merge
            gluon = [LaunchConfig(block_n=bn, num_stages=st, num_splits=s, backend="gluon", fused_merge=f)
                     for bn, st in blocks if gluon_smem_bytes(bn, st) <= SMEM_LIMIT
                     for s in split_counts(bn)
                     for f in ((True,) if s == 1 else merges) if not (f and s > 1 and b * s > sms)]
            configs["gluon_bf16"] = configs["gluon_fp8"] = gluon
        kernels = [
            ("triton_bf16", lambda c: (lambda: sparse_mla_decode_triton(**case, config=c)), ref_out, 1024),
            ("triton_fp8", lambda c: (lambda: sparse_mla_decode_fp8_triton(**fp8_case, kv_cache=cache, extra_cache=extra_cache, config=c)), ref8_out, fp8_layout.BYTES_PER_TOKEN),
            ("gluon_bf16", lambda c: (lambda: sparse_mla_decode_triton(**case, config=c)), ref_out, 1024),
            ("gluon_fp8", lambda c: (lambda: sparse_mla_decode_fp8_triton(**fp8_case, kv_cache=cache, extra_cache=extra_cache, config=c)), ref8_out, fp8_layout.BYTES_PER_TOKEN),
        ]
        for name, fn_for, ref, row_bytes in kernels:
            if name not in wanted:
                continue
            why = gluon_unavailable(case["q"], name.endswith("fp8")) if name.startswith("gluon") else None
            if why:
                rows.append(dict(kernel=name, B=b, error=f"not run: {why}"))
                continue
            cfg = best_config(fn_for, ref, b, configs[name]) if len(configs[name]) > 1 else configs[name][0]
            if cfg is None:
                rows.append(dict(kernel=name, B=b, error="no config gave a correct output"))
                continue
            cfg = resolved(cfg, name.split("_")[0], name.endswith("fp8"))
            is_gluon = name.startswith("gluon")
            # the sweep's best, and the launcher's own choice when it differs (row "<kernel>_default")
            runs = [(name, cfg)]
            if is_gluon:
                default = resolved(gluon_default, "gluon", name.endswith("fp8"))
                runs += [(f"{name}_default", default)] if default != cfg else []
            for label, c in runs:
                splits = gluon_splits(c, b, nblocks[c.block_n], sms, name.endswith("fp8")) if is_gluon else \
                    c.num_splits or choose_splits(b, nblocks[c.block_n], sms)
                info = dict(block_n=c.block_n, warps=c.num_warps, stages=c.num_stages, prefetch=c.prefetch,
                            splits=splits)
                if is_gluon:
                    info.update(warps=12, prefetch=None, loader_regs=c.loader_regs, merge=merge_of(c, b, splits, sms))
                try:
                    rows.append(measure(label, fn_for(c), ref, b, row_bytes, copy_gbs, info))
                except Exception as exc:  # a kernel that fails to compile or run is a result, not the end of the run
                    traceback.print_exc()
                    rows.append(dict(kernel=label, B=b, error=f"{type(exc).__name__}: {str(exc)[:300]}", **info))

        fm_run, fm_error = flashmla_call(fp8_case, cache, extra_cache)
        if fm_run is not None and "flashmla_fp8_v4" in wanted:
            try:
                rows.append(measure("flashmla_fp8_v4", fm_run, ref8_out, b, fp8_layout.BYTES_PER_TOKEN, copy_gbs))
            except (RuntimeError, AssertionError, TypeError) as exc:
                fm_error = f"{type(exc).__name__}: {exc}"
        del case, cache, extra_cache, fp8_case
        torch.cuda.empty_cache()

    resources = compiled_resources()
    for r in resources:
        print("  compiled:", r)
    print(f"device copy bandwidth (same run): {copy_gbs:.0f} GB/s; FlashMLA: {fm_error or 'loaded'}")
    print_table(rows, ["kernel", "B", "us", "us_eager", "GBps", "frac_copy", "TFLOPs", "rel_err", "block_n", "warps", "stages", "prefetch", "loader_regs", "splits", "merge", "error"])
    path = write_results("sparse_decode", dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, copy_gbs=copy_gbs,
        shapes=dict(H=H, D=D, window=W, topk=TOPK, context=CONTEXT), flashmla_error=fm_error, compiled=resources, rows=rows,
    ))
    md = path.with_suffix(".md")
    md.write_text(markdown(rows, copy_gbs, fm_error, torch.cuda.get_device_name(0)))
    print(f"wrote {path} and {md}")
    return 0


def merge_of(cfg: LaunchConfig, b: int, splits: int, sms: int) -> str:
    """How the Gluon launch merges this config's splits."""
    return "-" if splits == 1 else "fused" if fuses_merge(cfg, b, splits, sms) else "kernel"


def markdown(rows: list[dict], copy_gbs: float, fm_error: str | None, device: str) -> str:
    cols = ["kernel", "B", "us", "us_eager", "GBps", "frac_copy", "TFLOPs", "rel_err", "block_n", "warps", "stages",
            "prefetch", "loader_regs", "splits", "merge"]
    lines = [
        f"# sparse_decode on {device}",
        "",
        f"64 heads, D=512, window {W} + top-{TOPK} rows per query; cold-L2 median of CUDA-graph replays (`us`; "
        f"`us_eager` adds Python launch cost); device copy in the same run: "
        f"{copy_gbs:.0f} GB/s. GB/s counts the bytes the op needs (selected rows + Q + O + lse + indices). "
        f"FlashMLA: {fm_error or 'sgl-flash-mla SM90 sparse decode, use_legacy=True, kv_format=V4'}.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else f"{v:.1%}" if c == "frac_copy" else f"{v:.0f}" if c == "GBps" else f"{v:.3g}" if isinstance(v, float) else str(v))
        if "error" in r:
            cells[-1] += f" ({r['error']})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
