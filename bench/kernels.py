"""Kernel benchmarks on one GPU: `python -m bench.kernels {sparse_decode,indexer_topk}`.

Every run measures its own ceiling (device-to-device copy bandwidth) so that results are reported as
fractions of a number seen in the same run, never against a datasheet. Results go to
bench/results/<name>.json plus a printed table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys

from bench.common import versions

BENCHES = {
    "sparse_decode": "bench.sparse_decode",
    "indexer_topk": "bench.indexer_topk",
    "sglang_decode": "bench.sglang_decode",
}
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (median)."""
    import torch
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_us(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of `fn` in microseconds, L2 flushed before every call (triton's do_bench does that)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def write_results(name: str, payload: dict) -> pathlib.Path:
    """bench/results/<name>.json: the payload with the run's versions (`versions`) beside it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = dict(payload, versions=payload.get("versions") or versions())
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", choices=sorted(BENCHES))
    args, rest = parser.parse_known_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("kernel benchmarks need a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[args.bench])
    return module.run(rest)


if __name__ == "__main__":
    sys.exit(main())
