"""Kernel benchmarks on one GPU: `python -m bench.kernels NAME`, NAME one of `BENCHES` below.

Every run measures its own ceiling (device-to-device copy bandwidth), so results are fractions of a number seen in
the same run, never of a datasheet. Results go to bench/results/<name>.json (+ .md) and a printed table.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bench.common import RESULTS, versions, write

BENCHES = ("sparse_decode", "indexer_topk", "sglang_decode", "sglang_metadata", "sm120_decode", "sm120_reference")


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (median)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (bench_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


def bench_us(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of `fn` in microseconds, L2 flushed before every call (triton's do_bench does that)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graph_and_eager_us(fn) -> tuple[float, float]:
    """(CUDA-graph replay us, eager us): cold-L2 medians over >= 100 ms of back-to-back calls."""
    return bench_us(graphed(fn), 25, 100), bench_us(fn, 25, 100)


def graphed(fn):
    """`fn` captured in a CUDA graph (after one eager call that compiles / initialises): its replay."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def write_results(name: str, payload: dict, md: str | None = None):
    """bench/results/<name>.json (the payload with the run's versions beside it) and .md (the table, when given, also
    printed)."""
    if md is not None:
        print(md, end="")
    return write(RESULTS / name, dict(payload, versions=payload.get("versions") or versions()), md)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", choices=BENCHES)
    args, rest = parser.parse_known_args(argv)
    import torch

    if rest[:1] != ["render"] and not torch.cuda.is_available():  # render: tables from a run's JSON, no GPU
        print("kernel benchmarks need a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    return importlib.import_module(f"bench.{args.bench}").run(rest)


if __name__ == "__main__":
    sys.exit(main())
