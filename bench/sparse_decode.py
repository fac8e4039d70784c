"""Sparse MLA decode on one GPU: `python -m bench.kernels sparse_decode [--batches 1,8,32,64,128] [--profile]`.

DeepSeek-V4 CSA-layer shapes (64 heads, D = 512, a 128-row window + top-512 compressed entries per query, every
query over its own region of a large cache, so rows come from HBM). Per batch size and kernel (the PyTorch
reference, Triton and Gluon on bf16 rows and on the V4 fp8 layout, FlashMLA's SM90 sparse decode on the same fp8
cache when `flash_mla` loads): cold-L2 median of CUDA-graph replays and of eager calls, GB/s over the bytes the op
needs (rows + Q + O + lse + indices) and as a fraction of the copy bandwidth measured in the same run, TFLOP/s, and
the launch the kernel took. A kernel whose output disagrees with the reference gets its error, not a time.
`--profile` only runs the Triton kernels a few times (the target of `bench/gpu.sh ncu`).
"""

from __future__ import annotations

import argparse
import traceback

import torch

from bench.common import ints, md_columns
from bench.kernels import bench_us, copy_bandwidth_gbs, graphed, write_results
from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout, quantize_kv_v4, sparse_mla_decode_ref
from dsv4_cluster.kernels.sparse_mla_decode.launch import (LaunchConfig, gluon_unavailable, resolved,
                                                           sparse_mla_decode_fp8_triton, sparse_mla_decode_triton)
from dsv4_cluster.kernels.sparse_mla_decode.reference import attend, gather_rows
from dsv4_cluster.kernels.sparse_mla_decode.splits import choose_splits, fuses_merge, gluon_splits

H, D, W, TOPK = 64, 512, 128, 512
CONTEXT = 4096  # tokens per request: main-cache region; L/4 compressed entries in the extra cache
MAX_REL_ERR = 2e-2
KERNELS = ("torch_reference_bf16", "triton_bf16", "triton_fp8", "gluon_bf16", "gluon_fp8", "flashmla_fp8_v4")
COLUMNS = ["kernel", "B", "us", "us_eager", "GBps", "frac_copy", "TFLOPs", "rel_err", "block_n", "warps", "stages",
           "prefetch", "loader_regs", "splits", "merge", "error"]


def make_inputs(b: int, seed: int = 0) -> dict:
    """Per request: window = its last 128 tokens, extra = 512 distinct of its L/4 compressed entries."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    comp, base = CONTEXT // 4, torch.arange(b, device="cuda")[:, None]
    q = torch.randn(b, H, D, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(b * CONTEXT, D, device="cuda", generator=g).to(torch.bfloat16)
    extra = torch.randn(b * comp, D, device="cuda", generator=g).to(torch.bfloat16)
    widx = (base * CONTEXT + CONTEXT - W + torch.arange(W, device="cuda")[None, :]).int()
    picks = torch.rand(b, comp, device="cuda", generator=g).argsort(dim=1)[:, :TOPK].sort(dim=1).values
    return dict(q=q, kv=kv, window_idx=widx, extra_kv=extra, extra_idx=(base * comp + picks).int(),
                sink=torch.randn(H, device="cuda", generator=g))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def flashmla_call(case: dict, cache: torch.Tensor, extra_cache: torch.Tensor):
    """A closure running FlashMLA's SM90 V4 sparse decode on our fp8 caches, or the import error."""
    try:
        import flash_mla
    except (ImportError, OSError, RuntimeError) as exc:  # a load failure (ABI, missing lib) is the result
        return None, f"{type(exc).__name__}: {exc}"
    b = case["q"].shape[0]
    lens = lambda n: torch.full((b,), n, dtype=torch.int32, device="cuda")  # noqa: E731
    k_view, e_view = fp8_layout.flashmla_view(cache), fp8_layout.flashmla_view(extra_cache)
    meta = flash_mla.get_mla_metadata()[0]

    def run():
        out, lse = flash_mla.flash_mla_with_kvcache(
            case["q"].view(b, 1, H, D), k_view, None, None, D, meta, softmax_scale=D**-0.5, is_fp8_kvcache=True,
            indices=case["window_idx"].view(b, 1, W), attn_sink=case["sink"], extra_k_cache=e_view,
            extra_indices_in_kvcache=case["extra_idx"].view(b, 1, TOPK), topk_length=lens(W),
            extra_topk_length=lens(TOPK), use_legacy=True, kv_format="V4")
        return out.view(b, H, D), lse

    return run, None


def measure(name, fn, ref_out, b, row_bytes, copy_gbs, extra=None):
    """Time of one CUDA-graph replay of `fn` (how decode runs), and of an eager call (adds Python launch cost)."""
    err = rel_err(fn()[0], ref_out)
    row = dict(kernel=name, B=b, rel_err=err, **(extra or {}))
    if not err < MAX_REL_ERR:
        return dict(row, error=f"output disagrees with the reference (relative error {err:.3g}); not timed")
    row["us_eager"] = us = bench_us(fn)
    try:
        us = bench_us(graphed(fn))
    except RuntimeError as exc:
        row["error"] = f"CUDA-graph capture failed ({type(exc).__name__}: {exc}); us is eager"
    gbs = b * ((W + TOPK) * (row_bytes + 4) + 2 * H * D * 2 + H * 4) / (us * 1e-6) / 1e9
    row.update(us=us, GBps=gbs, frac_copy=gbs / copy_gbs, TFLOPs=4.0 * b * H * (W + TOPK) * D / (us * 1e-6) / 1e12)
    print(f"  {name:22s} B={b:4d} {us:8.1f} us (eager {row['us_eager']:7.1f}) {gbs:7.0f} GB/s "
          f"{gbs / copy_gbs:5.1%} of copy  err {err:.2e} {extra or ''}")
    return row


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the Triton kernel (Triton's cache)."""
    from dsv4_cluster.kernels.sparse_mla_decode import kernel

    found = []
    try:
        for entry in kernel._sparse_decode_kernel.device_caches.values():
            for compiled in entry[0].values():
                compiled._init_handles()
                found.append(dict(regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared,
                                  warps=compiled.metadata.num_warps, stages=compiled.metadata.num_stages,
                                  async_copies=compiled.asm["ttgir"].count("async_copy_global_to_local"),
                                  wgmma=compiled.asm["ttgir"].count("warp_group_dot ")))
    except (AttributeError, KeyError, IndexError, TypeError) as exc:  # Triton's cache layout is internal
        found.append(dict(error=f"{type(exc).__name__}: {exc}"))
    return found


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sparse_decode")
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128])
    p.add_argument("--profile", action="store_true", help="only run the Triton kernels a few times (for ncu)")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated rows to measure")
    a = p.parse_args(argv)
    wanted = set(a.kernels.split(","))
    copy_gbs = None if a.profile else copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, fm_error = [], None
    for b in a.batches:
        case = make_inputs(b, seed=b)
        cache, extra_cache = quantize_kv_v4(case["kv"]), quantize_kv_v4(case["extra_kv"])
        fp8_case = {k: v for k, v in case.items() if k not in ("kv", "extra_kv")}
        bf16 = lambda c: (lambda: sparse_mla_decode_triton(**case, config=c))  # noqa: E731
        fp8 = lambda c: (lambda: sparse_mla_decode_fp8_triton(**fp8_case, kv_cache=cache,  # noqa: E731
                                                              extra_cache=extra_cache, config=c))
        if a.profile:   # three calls of each Triton kernel, default config, nothing timed
            for _ in range(3):
                bf16(None)(), fp8(None)()
            continue
        ref_out, _ = sparse_mla_decode_ref(**case)
        deq = {"kv": fp8_layout.dequantize_kv_v4(cache), "extra_kv": fp8_layout.dequantize_kv_v4(extra_cache)}
        ref8_out, _ = sparse_mla_decode_ref(**{**case, **deq})
        if "torch_reference_bf16" in wanted:   # the reference's math without its host-syncing index checks
            torch_ref = lambda: attend(case["q"], *gather_rows(case["kv"], case["window_idx"], case["extra_kv"],  # noqa: E731
                                                               case["extra_idx"]), case["sink"], D**-0.5)
            rows.append(measure("torch_reference_bf16", torch_ref, ref_out, b, 1024, copy_gbs))
        for name in KERNELS[1:5]:
            if name not in wanted:
                continue
            backend, is_fp8 = name.split("_")[0], name.endswith("fp8")
            if backend == "gluon" and (why := gluon_unavailable(case["q"], is_fp8)):
                rows.append(dict(kernel=name, B=b, error=f"not run: {why}"))
                continue
            c = resolved(LaunchConfig(backend=backend), backend, is_fp8)
            blocks = -(-W // c.block_n) + -(-TOPK // c.block_n)
            if backend == "gluon":
                splits = gluon_splits(c, b, blocks, sms, is_fp8)
                info = dict(block_n=c.block_n, warps=12, stages=c.num_stages, prefetch=None, splits=splits,
                            loader_regs=c.loader_regs,
                            merge="-" if splits == 1 else "fused" if fuses_merge(c, b, splits, sms) else "kernel")
            else:
                info = dict(block_n=c.block_n, warps=c.num_warps, stages=c.num_stages, prefetch=c.prefetch,
                            splits=c.num_splits or choose_splits(b, blocks, sms))
            try:
                rows.append(measure(name, (fp8 if is_fp8 else bf16)(c), ref8_out if is_fp8 else ref_out, b,
                                    fp8_layout.BYTES_PER_TOKEN if is_fp8 else 1024, copy_gbs, info))
            except Exception as exc:  # a kernel that fails to compile or run is a result, not the end of the run
                traceback.print_exc()
                rows.append(dict(kernel=name, B=b, error=f"{type(exc).__name__}: {str(exc)[:300]}", **info))
        fm_run, fm_error = flashmla_call(fp8_case, cache, extra_cache)
        if fm_run is not None and "flashmla_fp8_v4" in wanted:
            try:
                rows.append(measure("flashmla_fp8_v4", fm_run, ref8_out, b, fp8_layout.BYTES_PER_TOKEN, copy_gbs))
            except (RuntimeError, AssertionError, TypeError) as exc:
                fm_error = f"{type(exc).__name__}: {exc}"
        del case, cache, extra_cache, fp8_case
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    if a.profile:
        return 0
    resources, device = compiled_resources(), torch.cuda.get_device_name(0)
    print(f"device copy bandwidth (same run): {copy_gbs:.0f} GB/s; FlashMLA: {fm_error or 'loaded'}; "
          f"compiled: {resources}")
    path = write_results("sparse_decode", dict(
        device=device, copy_gbs=copy_gbs, flashmla_error=fm_error, compiled=resources,
        shapes=dict(H=H, D=D, window=W, topk=TOPK, context=CONTEXT), rows=rows), markdown(rows, copy_gbs, fm_error, device))
    print(f"wrote {path} and its .md")
    return 0


def markdown(rows: list[dict], copy_gbs: float, fm_error: str | None, device: str) -> str:
    return "\n".join([
        f"# sparse_decode on {device}", "",
        f"64 heads, D=512, window {W} + top-{TOPK} rows per query; cold-L2 median of CUDA-graph replays (`us`; "
        f"`us_eager` adds Python launch cost); device copy in the same run: {copy_gbs:.0f} GB/s. GB/s counts the "
        f"bytes the op needs (selected rows + Q + O + lse + indices). FlashMLA: "
        f"{fm_error or 'sgl-flash-mla SM90 sparse decode, use_legacy=True, kv_format=V4'}.", "",
        *md_columns(rows, [(c, c, {"frac_copy": ".1%", "GBps": ".0f"}.get(c, "")) for c in COLUMNS])]) + "\n"
