"""Host time of eager adapter calls against FlashMLA's: the whole table, or where one call's time goes.

Run on the GPU machine:
- `python -m bench.host_profile` (or `all [batches]`): per layer kind, B = 1 / 8 / 32 / 64 / 128 / 256
  and 16 / 64 real heads, eager and graph-replay us, ours vs FlashMLA, and host us per eager call (the rows of
  `bench/sglang_decode.py`, printed; no results file).
- `python -m bench.host_profile LAYER B REAL_HEADS` (e.g. c4 8 16): per-call wall time of the adapter
  and of FlashMLA, Python function calls per adapter call, and the 25 functions with the most own time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from dsv4_cluster.kernels.sglang_adapters import flash_mla_with_kvcache
from bench.sglang_decode import BATCHES, decode_rows, host_us, plan_stats
from bench.kernels import copy_bandwidth_gbs, print_table
from dsv4_cluster.kernels.sglang_cases import decode_case

CALLS = 500


def table(batches=BATCHES) -> int:
    rows = decode_rows(copy_bandwidth_gbs(), batches)
    print_table(rows, ["layer", "B", "real_heads", "impl", "us", "us_eager", "host_us", "eager_minus_flashmla",
                       "speedup_vs_flashmla"])
    print(plan_stats())
    return 0


def profile(kind: str, b: int, h: int) -> int:
    args = decode_case(kind, b, h, seed=0)
    ours = lambda: flash_mla_with_kvcache(tile_scheduler_metadata=None, **args)  # noqa: E731  (as the plugin calls)
    print(f"{kind} B={b} real_heads={h}: adapter {host_us(ours, CALLS):.1f} us of host per eager call")
    try:
        import flash_mla
    except ImportError:
        pass
    else:
        meta = flash_mla.get_mla_metadata()[0]
        stock = lambda: flash_mla.flash_mla_with_kvcache(tile_scheduler_metadata=meta, use_legacy=True,  # noqa: E731
                                                         **args)
        print(f"  FlashMLA as SGLang calls it: {host_us(stock, CALLS):.1f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        ours()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    print(f"  Python function calls per adapter call: {stats.total_calls / CALLS:.1f}")
    stats.sort_stats("tottime").print_stats(25)
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] == "all":
        batches = tuple(int(x) for x in argv[1].split(",")) if len(argv) > 1 else BATCHES
        return table(batches)
    kind, b, h = (argv + ["c4", "8", "16"][len(argv):])[:3]
    return profile(kind, int(b), int(h))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
