"""When each CTA of the Gluon sparse decode reaches each phase: %globaltimer stamps from inside the kernel.

`python -m dsv4_cluster.bench.trace_sparse_decode [batches] [splits]` on the H200 runs the kernel with
TRACE on (launch._TRACE) on the benchmark's inputs, full and with every query empty, bf16 and fp8, cold L2
(a 256 MB buffer is written before each launch), REPS launches each. Per phase (gluon_loaders.TRACE_PHASES)
it prints the CTAs' earliest / median / latest stamp in us after the launch's earliest CTA start, as the
median over the launches, and the span (first start to the last epilogue issued). Stores are stamped when
issued, not when they land. The graph-replay time of the same call (as in the benchmark) is printed beside
it. Results are timing only; nothing is checked (the GPU tests cover TRACE off, which compiles to the same
SASS as before the stamps existed).
"""

from __future__ import annotations

import sys

import torch

from dsv4_cluster.bench.kernels import bench_us
from dsv4_cluster.bench.sparse_decode import graphed, make_inputs
from dsv4_cluster.kernels.sparse_mla_decode import launch, quantize_kv_v4
from dsv4_cluster.kernels.sparse_mla_decode.gluon_loaders import TRACE_PHASES, TRACE_SLOTS
from dsv4_cluster.kernels.sparse_mla_decode.launch import LaunchConfig

REPS = 20


def traced(run, b: int, max_splits: int) -> torch.Tensor:
    """[REPS, CTAs, len(TRACE_PHASES)] float64 us after each launch's earliest CTA start (nan: not reached);
    max_splits: at least the launch's splits per query (the buffer has a row per CTA)."""
    slots = TRACE_SLOTS.value
    buf = torch.full((b * max_splits * slots,), -1, dtype=torch.int64, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    out = []
    launch._TRACE = buf
    try:
        for _ in range(REPS + 2):
            buf.fill_(-1)
            flush.zero_()
            run()
            torch.cuda.synchronize()
            t = buf.view(-1, slots)[:, : len(TRACE_PHASES)].cpu()
            t = t[t[:, 0] >= 0]  # the CTAs this launch had
            rel = (t - t[:, 0].min()).double() / 1e3
            rel[t < 0] = float("nan")
            out.append(rel)
    finally:
        launch._TRACE = None
    return torch.stack(out[2:])


def report(name: str, t: torch.Tensor, graph_us: float) -> None:
    reps, ctas, _ = t.shape
    print(f"\n{name}: {ctas} CTAs, graph replay {graph_us:.1f} us; us after the first CTA start "
          f"(median of {reps} cold-L2 launches)")
    print(f"  {'phase':28s} {'first':>7s} {'median':>7s} {'last':>7s}")
    for p, phase in enumerate(TRACE_PHASES):
        col = t[:, :, p]
        if torch.isnan(col).all():
            continue
        first = torch.nanmedian(torch.stack([c[~torch.isnan(c)].min() for c in col]))
        med = torch.nanmedian(torch.stack([torch.nanmedian(c) for c in col]))
        last = torch.nanmedian(torch.stack([c[~torch.isnan(c)].max() for c in col]))
        print(f"  {phase:28s} {first:7.2f} {med:7.2f} {last:7.2f}")
    ends = torch.stack([t[:, :, 7], t[:, :, 8]], dim=-1).amax(dim=(1, 2))
    stamps = t[0][~torch.isnan(t[0])].unique()
    step = stamps.diff().min().item() * 1e3 if stamps.numel() > 1 else float("nan")
    print(f"  span (first start -> last epilogue issued): {ends.median():.2f} us; smallest step between two "
          f"stamps of a launch: {step:.0f} ns (the timer's resolution, at most)")


def main(argv: list[str]) -> int:
    """argv: [batches, e.g. 64,128] [split count for every B (default: the launcher's)]"""
    batches = [int(x) for x in (argv[0] if argv else "64,128").split(",")]
    splits = int(argv[1]) if len(argv) > 1 else 0
    for b in batches:
        case = make_inputs(b, seed=b)
        cache, extra = quantize_kv_v4(case["kv"]), quantize_kv_v4(case["extra_kv"])
        empty = {**case, "window_lens": torch.zeros(b, dtype=torch.int32, device="cuda"),
                 "extra_lens": torch.zeros(b, dtype=torch.int32, device="cuda")}
        cfg = LaunchConfig(backend="gluon", num_splits=splits)
        for fp8 in (False, True):
            for what, c in (("full", case), ("empty queries", empty)):
                def run(c=c, fp8=fp8):
                    if fp8:
                        rest = {k: v for k, v in c.items() if k not in ("kv", "extra_kv")}
                        return launch.sparse_mla_decode_fp8_triton(**rest, kv_cache=cache, extra_cache=extra,
                                                                   config=cfg)
                    return launch.sparse_mla_decode_triton(**c, config=cfg)

                graph_us = bench_us(graphed(run), rep_ms=100)
                # 16: the most splits the launcher chooses (splits.choose_splits)
                report(f"B={b} {'fp8' if fp8 else 'bf16'} {what}", traced(run, b, max(splits, 16)), graph_us)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
