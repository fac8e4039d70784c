"""Where the Gluon sparse decode spends its time: the kernel with one stage dropped (timing only).

`python -m dsv4_cluster.bench.probe_sparse_decode [batches] [splits]` on the H200 prints, per batch size
and config, the CUDA-graph replay time of the full kernel, of the kernel without math (loads + barriers
only), without row loads (math on whatever shared memory holds), and, for fp8, without dequantisation; the
full kernel with the merge kernel instead of the fused merge, and every query empty (the fixed cost);
plus a plain PyTorch gather of the same rows (index_select: the bytes at many-warp occupancy) as
the bandwidth a gather can reach. The probes give wrong outputs by design; nothing is checked.
"""

from __future__ import annotations

import sys

import torch

from dsv4_cluster.bench.kernels import bench_us, copy_bandwidth_gbs
from dsv4_cluster.bench.sparse_decode import graphed, make_inputs, required_bytes
from dsv4_cluster.kernels.sparse_mla_decode import launch, quantize_kv_v4
from dsv4_cluster.kernels.sparse_mla_decode.launch import LaunchConfig

PROBES = {0: "full", 1: "no math", 2: "no row loads", 3: "no dequant"}


def splits_of(b: int, bn: int) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return launch.choose_splits(b, -(-128 // bn) + -(-512 // bn), sms)


def main(argv: list[str]) -> int:
    """argv: [batches, e.g. 8,128] [split count for every B (default: choose_splits)]"""
    batches = [int(x) for x in (argv[0] if argv else "8,128").split(",")]
    forced_splits = int(argv[1]) if len(argv) > 1 else 0
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s")
    floor = torch.empty(1, device="cuda")
    print(f"graph replay of one tiny kernel (the timing floor): {bench_us(graphed(lambda: floor.add_(1)), rep_ms=100):.1f} us")
    for b in batches:
        case = make_inputs(b, seed=b)
        rows = torch.cat([case["window_idx"], case["extra_idx"] + case["kv"].shape[0]], dim=1).view(-1).long()
        both = torch.cat([case["kv"], case["extra_kv"]])
        gather_us = bench_us(graphed(lambda: both.index_select(0, rows)))
        gbs = rows.numel() * 1024 * 2 / (gather_us * 1e-6) / 1e9
        print(f"B={b:4d} torch index_select of the rows: {gather_us:7.1f} us ({gbs:.0f} GB/s read+write, "
              f"{rows.numel() * 1024 / (gather_us * 1e-6) / 1e9:.0f} GB/s read)")
        cache, extra = quantize_kv_v4(case["kv"]), quantize_kv_v4(case["extra_kv"])
        # the fixed cost: every query empty (launch, Q load, epilogue, merge)
        empty = {**case, "window_lens": torch.zeros(b, dtype=torch.int32, device="cuda"),
                 "extra_lens": torch.zeros(b, dtype=torch.int32, device="cuda")}
        for fp8, cfgs in ((False, [(64, 2)]), (True, [(64, 2), (32, 3)])):
            for bn, st in cfgs:
                splits = forced_splits or splits_of(b, bn)
                cfg = LaunchConfig(block_n=bn, num_stages=st, backend="gluon", num_splits=splits)

                def run(cfg=cfg, fp8=fp8, c=case):
                    if fp8:
                        rest = {k: v for k, v in c.items() if k not in ("kv", "extra_kv")}
                        return launch.sparse_mla_decode_fp8_triton(**rest, kv_cache=cache, extra_cache=extra, config=cfg)
                    return launch.sparse_mla_decode_triton(**c, config=cfg)

                line = []
                for probe in (0, 1, 2, 3) if fp8 else (0, 1, 2):
                    launch._PROBE = probe
                    line.append(f"{PROBES[probe]} {bench_us(graphed(run), rep_ms=100):6.1f}")
                launch._PROBE = 0
                if splits > 1:  # the same with the merge kernel after it instead of the fused merge
                    unfused = LaunchConfig(block_n=bn, num_stages=st, backend="gluon", num_splits=splits, fused_merge=False)
                    line.append(f"full, merge kernel {bench_us(graphed(lambda: run(unfused)), rep_ms=100):6.1f}")
                for n, fused in ((1, True), (splits, True), (splits, False)) if splits > 1 else ((1, True),):
                    c2 = LaunchConfig(block_n=bn, num_stages=st, backend="gluon", num_splits=n, fused_merge=fused)
                    us = bench_us(graphed(lambda: run(c2, c=empty)), rep_ms=100)
                    how = "" if n == 1 else ", fused" if fused else ", merge kernel"
                    line.append(f"empty queries (splits {n}{how}) {us:6.1f}")
                row_bytes = 584 if fp8 else 1024
                print(f"B={b:4d} {'fp8 ' if fp8 else 'bf16'} bn={bn} st={st} splits={splits}: " + " | ".join(line)
                      + f"  (full = {required_bytes(b, row_bytes) / copy / 1e3:.1f} us at copy speed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
