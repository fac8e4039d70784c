"""SGLang's DeepSeek-V4 decode calls: our adapters against what SGLang runs today, on the same tensors.

    python -m bench.kernels sglang_decode [BATCHES]       # bench/results/sglang_decode.{json,md}
    python -m bench.kernels sglang_decode --ncu KIND B    # two calls of ours and FlashMLA's: an Nsight Compute target
    python -m bench.kernels sglang_decode --host KIND B H # where the host time of one eager adapter call goes

Sparse decode per layer kind (window; + ratio-4 top-512; + ratio-128) and B, at 64 real heads and at TP4 (16 of 64):
FlashMLA as SGLang calls it vs the adapter (and, at 16 heads, told so and the Triton kernel), cold-L2 median of
CUDA-graph replays (`us`) and eager calls (`us_eager`). Indexer + top-k on fp8 keys at B = 32, L in {4K, 64K, 256K}:
the adapters with capacity for 1M context and for L, and PyTorch scoring + torch.topk (a stock path). `host_us`:
host time per eager call (issued back to back, one sync). The copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from bench.common import ints, md_columns, versions
from bench.kernels import bench_us, copy_bandwidth_gbs, graph_and_eager_us, graphed, write_results
from dsv4_cluster.kernels.sglang_adapters import flash_mla_with_kvcache, fp8_paged_mqa_logits, topk_transform_paged_v2
from dsv4_cluster.kernels.sparse_mla_decode.launch import LaunchConfig
from dsv4_cluster.kernels.sglang_cases import LAYERS, decode_case, indexer_case, live_rows

BATCHES = (1, 8, 32, 64, 128, 256)


def host_us(fn, calls: int = 200) -> float:
    """Host time per eager call: `calls` calls issued back to back, then one sync (not timed)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def decode_rows(copy_gbs: float, batches=BATCHES) -> list[dict]:
    """Per layer kind and B: FlashMLA as SGLang calls it; the adapter as the plugin calls it (no real_heads: all
    64 heads computed, the same call at 16 and at 64 real heads, so measured once); at 16 real heads also the
    adapter told the real count (`real_heads=16`: the table's 16-head row, on sm_90 the mma.sync kernel) and the
    16-head Triton kernel (that row's fallback)."""
    import flash_mla

    rows = []
    for kind in LAYERS:
        for b in batches:
            for real in (64, 16):
                args = decode_case(kind, b, real, seed=b, full=True, window_tokens=65536, extra_tokens=65536)
                meta = flash_mla.get_mla_metadata()[0]
                nbytes = live_rows(args) * 584 + b * real * 512 * 4
                if real == 64:
                    impls = {"flashmla": lambda: flash_mla.flash_mla_with_kvcache(
                                 tile_scheduler_metadata=meta, use_legacy=True, **args),
                             "adapter": lambda: flash_mla_with_kvcache(tile_scheduler_metadata=None, **args)}
                else:
                    impls = {"adapter_h16": lambda: flash_mla_with_kvcache(tile_scheduler_metadata=None,
                                                                           real_heads=real, **args),
                             "adapter_triton_h16": lambda: flash_mla_with_kvcache(
                                 tile_scheduler_metadata=None, real_heads=real, config=LaunchConfig(backend="triton"),
                                 **args)}
                for name, fn in impls.items():
                    us, eager = graph_and_eager_us(fn)
                    if name == "flashmla":
                        base, base_eager = us, eager
                    gbs = nbytes / (us * 1e-6) / 1e9
                    rows.append(dict(bench="decode", layer=kind, B=b, real_heads=real, impl=name, us=us,
                                     us_eager=eager, host_us=host_us(fn, 100), speedup_vs_flashmla=base / us,
                                     eager_minus_flashmla=eager - base_eager, GBps=gbs, frac_copy=gbs / copy_gbs))
                    print(rows[-1], flush=True)
    return rows


def plan_stats() -> dict:
    """Per adapter: launch plans kept and why keys were not (launch_cache), after the runs above."""
    from dsv4_cluster.kernels.sglang_adapters import flash_mla, indexer, topk

    return {m._PLANS.name: dict(plans=len(m._PLANS.plans), replayable=sum(p.steps is not None for p in
                                m._PLANS.plans.values()), uncached=dict(m._PLANS.uncached))
            for m in (flash_mla, indexer, topk)}


def _torch_stock(c, cap):
    """PyTorch scoring of the live keys into a capacity-wide -inf row, then torch.topk over the capacity."""
    from dsv4_cluster.kernels.indexer.fp8_keys import dequantize_keys

    keys = c["kv"].view(c["kv"].shape[0], -1)
    dim = c["q"].shape[-1]
    n = int(c["lens"].max())
    pages = c["table"][:, : -(-n // 64)].long()

    def run():
        k = dequantize_keys(keys[pages.reshape(-1)], dim).view(pages.shape[0], -1, dim)[:, :n]
        s = (torch.relu(torch.einsum("bhd,btd->bht", c["q"][:, 0].float(), k)) * c["weights"][:, :, None]).sum(1)
        row = torch.full((pages.shape[0], cap), float("-inf"), device="cuda")
        row[:, :n] = s
        return torch.topk(row, 512, dim=1).indices

    return run


def _fused(c, fp8_dot: bool):
    """The fused indexer + top-k kernel alone on the case's tensors: fp8 products, or both widened to bf16."""
    from dsv4_cluster.kernels.indexer.fused_topk import indexer_topk_triton

    keys = c["kv"].view(c["kv"].shape[0], -1)
    return indexer_topk_triton(c["q"][:, 0], c["weights"], keys, c["table"], c["lens"], 512, fp8=True,
                               check_values=False, fp8_dot=fp8_dot)


def indexer_rows(copy_gbs: float) -> list[dict]:
    rows = []
    for context in (4096, 65536, 262144):
        length = context // 4  # compressed entries (ratio 4)
        per_cap = {}
        for cap in (1 << 18, length):  # 1M context, or exactly L
            c = indexer_case(32, [length] * 32, capacity=cap, seed=length)
            out = torch.empty(32, 512, dtype=torch.int32, device="cuda")

            def step(c=c, cap=cap, out=out):
                logits = fp8_paged_mqa_logits(c["q"], c["kv"], c["weights"], c["lens2d"], c["table"], None, cap,
                                              False)
                topk_transform_paged_v2(logits, c["lens"], c["table"], out, 64, None)

            us, eager = graph_and_eager_us(step)
            per_cap[cap] = us
            upcast_us = bench_us(graphed(lambda c=c: _fused(c, fp8_dot=False)), 25, 100)
            fp8_dot_us = bench_us(graphed(lambda c=c: _fused(c, fp8_dot=True)), 25, 100)
            gbs = 32 * length * 132 / (us * 1e-6) / 1e9
            rows.append(dict(bench="indexer_topk", L=context, entries=length, capacity=cap, impl="adapters", us=us,
                             us_eager=eager, host_us=host_us(step), eager_over_graph=eager / us, GBps_keys=gbs,
                             frac_copy=gbs / copy_gbs, fused_fp8_dot_us=fp8_dot_us, fused_bf16_upcast_us=upcast_us))
            print(rows[-1], flush=True)
        rows[-2]["cap1M_over_capL"] = per_cap[1 << 18] / per_cap[length]
        c = indexer_case(32, [length] * 32, capacity=1 << 18, seed=length)
        us = bench_us(_torch_stock(c, 1 << 18), 25, 100)
        rows.append(dict(bench="indexer_topk", L=context, entries=length, capacity=1 << 18, impl="torch_score_topk",
                         us=us, speedup_of_adapters=us / rows[-2]["us"]))
        print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict], copy_gbs: float, device: str) -> str:
    v = versions()
    lines = [f"# sglang_decode on {device}", "", f"torch {v['torch']}, Triton {v['triton']}.", "",
             f"Device copy in the same run: {copy_gbs:.0f} GB/s. `us`: cold-L2 median of CUDA-graph replays; "
             "`us_eager`: of eager calls. FlashMLA: sgl-flash-mla 1.0.0 called as SGLang 0.5.23 calls it "
             "(use_legacy=True, 256-token window pages). Full lists (window 128, extra 512).", "",
             "`adapter` is the call as the plugin makes it (no real head count: 64 heads computed, the same call at 16 "
             "and 64 real heads); `adapter_h16` is told 16 real heads; `eager - FM`: us_eager minus FlashMLA's.", "",
             *md_columns([r for r in rows if r["bench"] == "decode"], [
                 ("layer", "layer", ""), ("B", "B", ""), ("real_heads", "real_heads", ""), ("impl", "impl", ""),
                 ("us", "us", ".1f"), ("us_eager", "us_eager", ".1f"), ("host_us", "host_us", ".1f"),
                 ("x FlashMLA", "speedup_vs_flashmla", ".2f"), ("eager - FM", "eager_minus_flashmla", "+.1f"),
                 ("GB/s", "GBps", ".0f"), ("of copy", "frac_copy", ".1%")]),
             "", "Indexer + top-k (B = 32, fp8 keys, 132 B each; entries = L / 4; capacity in entries):", "",
             *md_columns([r for r in rows if r["bench"] == "indexer_topk"], [
                 ("L", "L", ""), ("entries", "entries", ""), ("capacity", "capacity", ""), ("impl", "impl", ""),
                 ("us", "us", ".1f"), ("us_eager", "us_eager", ".1f"), ("host_us", "host_us", ".1f"),
                 ("eager/graph", "eager_over_graph", ".2f"), ("1M/L", "cap1M_over_capL", ".3f"),
                 ("key GB/s", "GBps_keys", ".0f"), ("of copy", "frac_copy", ".1%"),
                 ("stock/ours", "speedup_of_adapters", ".1f"), ("fused, fp8 dot", "fused_fp8_dot_us", ".1f"),
                 ("fused, bf16 upcast", "fused_bf16_upcast_us", ".1f")]),
             *(f"\nIndexer + top-k failed: {r['error']}" for r in rows if r["bench"] == "indexer_topk_error")]
    stats = [r for r in rows if r["bench"] == "plans"]
    if stats:
        lines += ["", "Launch plans after the run (`launch_cache`): " + "; ".join(
            f"{name}: {s['plans']} kept ({s['replayable']} replayable), not kept: {s['uncached'] or 'none'}"
            for name, s in stats[-1]["stats"].items())]
    return "\n".join(lines) + "\n"


def ncu_case(kind: str, b: int) -> None:
    """Two eager calls of ours (as the plugin calls it) and two of FlashMLA on one case: the target of
    `NCU_CASE` of `bash bench/gpu.sh sglang_decode` (Nsight Compute profiles the kernels these launch)."""
    import flash_mla

    args = decode_case(kind, b, 64, seed=b, full=True, window_tokens=65536, extra_tokens=65536)
    for _ in range(2):
        flash_mla_with_kvcache(tile_scheduler_metadata=None, **args)
    for _ in range(2):
        flash_mla.flash_mla_with_kvcache(tile_scheduler_metadata=flash_mla.get_mla_metadata()[0], use_legacy=True,
                                         **args)
    torch.cuda.synchronize()
    print(f"ncu case {kind} B={b}: live rows {live_rows(args)} x 584 B = {live_rows(args) * 584 / 1e6:.1f} MB", flush=True)


def host_profile(kind: str, b: int, h: int, calls: int = 500) -> None:
    """Per-call host time of the adapter (as the plugin calls it) and of FlashMLA, Python calls per adapter call, and
    the 25 functions with the most own time."""
    args = decode_case(kind, b, h, seed=0)
    ours = lambda: flash_mla_with_kvcache(tile_scheduler_metadata=None, **args)  # noqa: E731
    print(f"{kind} B={b} real_heads={h}: adapter {host_us(ours, calls):.1f} us of host per eager call")
    try:
        import flash_mla
    except ImportError:
        pass
    else:
        meta = flash_mla.get_mla_metadata()[0]
        stock = lambda: flash_mla.flash_mla_with_kvcache(tile_scheduler_metadata=meta, use_legacy=True, **args)  # noqa: E731
        print(f"  FlashMLA as SGLang calls it: {host_us(stock, calls):.1f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        ours()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    print(f"  Python function calls per adapter call: {stats.total_calls / calls:.1f}")
    stats.sort_stats("tottime").print_stats(25)


def run(argv: list[str]) -> int:
    if argv[:1] in (["--ncu"], ["--host"]):
        kind, b, h = (argv[1:] + ["c4", "8", "16"][len(argv) - 1:])[:3]
        ncu_case(kind, int(b)) if argv[0] == "--ncu" else host_profile(kind, int(b), int(h))
        return 0
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    batches = tuple(ints(argv[0])) if argv else BATCHES
    device = torch.cuda.get_device_name()
    rows = decode_rows(copy_gbs, batches)
    write_results("sglang_decode", dict(device=device, copy_GBps=copy_gbs, rows=rows))
    from triton.compiler.errors import CompilationError

    try:
        rows += indexer_rows(copy_gbs)
    except (RuntimeError, CompilationError) as exc:  # a kernel that fails to build or run: recorded, not hidden
        rows.append(dict(bench="indexer_topk_error", error=f"{type(exc).__name__}: {exc}"))
        print(rows[-1], flush=True)
    rows.append(dict(bench="plans", stats=plan_stats()))
    write_results("sglang_decode", dict(device=device, copy_GBps=copy_gbs, rows=rows), markdown(rows, copy_gbs, device))
    return 0
