"""Where the host time of an eager adapter call goes: cProfile over many eager calls, top functions.

Run on the GPU machine: `python -m dsv4_cluster.bench.host_profile [layer] [B] [real_heads]` (defaults c4 8 16).
Prints the per-call wall time of the adapter and of FlashMLA (when installed) and the 25 functions with the
most own time per call. A diagnostic for bench/sglang_decode.py's host_us column; it writes no results file.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from dsv4_cluster.kernels.sglang_adapters import flash_mla_with_kvcache
from dsv4_cluster.bench.sglang_decode import host_us
from dsv4_cluster.kernels.sglang_cases import decode_case

CALLS = 500


def main(argv: list[str]) -> int:
    kind, b, h = (argv + ["c4", "8", "16"][len(argv):])[:3]
    args = decode_case(kind, int(b), int(h), seed=0)
    ours = lambda: flash_mla_with_kvcache(tile_scheduler_metadata=None, real_heads=int(h), **args)  # noqa: E731
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
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
