"""How a sparse-decode launch splits each query's rows: the split count (`choose_splits`, `gluon_splits`), the
16-head kernel's floor on a split's live blocks (`h16_min_blocks`) and whether the Gluon kernel merges the splits
itself (`fuses_merge`). Depends on shapes only (batch, blocks per query, SMs), so a call stays CUDA-graph
capturable. The constants are fitted to H200 and H100 measurements (bench/results/, DEVELOPERS.md)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import LaunchConfig

FUSED_MERGE_MIN_SPLITS = 4  # below, the merge kernel measured faster (H200: 2 splits at B = 8, 32, 64)


def fuses_merge(config: LaunchConfig, batch: int, splits: int, num_sms: int) -> bool:
    """Whether the Gluon launch merges its splits inside the kernel: when asked (config.fused_merge; None:
    from FUSED_MERGE_MIN_SPLITS splits on) and every CTA can be resident at once (one per SM: the
    cooperative launch guarantees it, or fails). Otherwise the merge kernel runs after it."""
    wanted = splits >= FUSED_MERGE_MIN_SPLITS if config.fused_merge is None else config.fused_merge
    return splits > 1 and wanted and batch * splits <= num_sms


# The 16-head mma.sync Gluon kernel (4 warps, 255 registers a thread as compiled on an H100, 49,664 B of shared
# memory) runs two CTAs an SM, so its splits spread B x splits programs over twice the SMs. H200, c4, Triton 3.8,
# graph, against the one-CTA count: B = 64, 4 splits 37.3 us vs 2 splits 41.7; B = 128, 2 splits 58.3 vs 1 split
# 68.7; B = 256, 1 split either way (the probe in DEVELOPERS.md, "16-head splits").
MMA_V2_16_HEAD_CTAS_PER_SM = 2

MERGE_COST = 0.03  # choose_splits: a split's merge, in blocks per (query, split)
# Gluon on bf16 rows: an unsplit query's output is cheap (stored through shared memory) and its blocks are (no
# dequantisation), so the merge weighs more against them: H200, B = 64, 1 split 30.0 us vs 2 splits 33.0
# (B = 48 29.0 vs 29.1). On fp8 rows 2 splits stay the faster: 35.8 vs 40.9 at B = 64, 33.2 vs 40.1 at B = 48
# (`git show cfdfdebcc0:bench/results/sparse_decode_ab_session7.log`).
GLUON_BF16_MERGE_COST = 0.04


def choose_splits(batch: int, num_blocks: int, num_sms: int, fused: bool = False,
                  merge_cost: float = MERGE_COST) -> int:
    """Splits per query. With the fused merge (Gluon) and room for at least FUSED_MERGE_MIN_SPLITS splits
    per query on the SMs: one block per split (min(blocks, SMs // B) splits), and 16 at B <= 2, where the
    extra splits have no rows but shrink each split's share of the merge (H200: 14.9 vs 16.2 us at B = 1).
    Otherwise (merge kernel, one CTA per SM) the count minimising waves x (blocks per split + 1) + merge_cost x
    batch x splits, in units of one block's time: + 1 for a program's fixed cost (Q load, epilogue), the
    last term for the merge, whose partial outputs (128 KB per query and split) are written and read once
    more; ties go to fewer splits. Fitted to the H200 sweeps (bench/results/sparse_decode.md): fused, 16 / 10
    / 4 splits at B = 1 / 8 / 32; merge kernel, 10 / 5 / 4 / 2 / 1 at B = 1 / 8 / 32 / 64 / 128 (Gluon on
    bf16 rows: GLUON_BF16_MERGE_COST, 1 split at B = 64; see `gluon_splits`)."""
    if fused and batch * FUSED_MERGE_MIN_SPLITS <= num_sms:
        return min(num_sms // batch, 16 if batch <= 2 else max(num_blocks, FUSED_MERGE_MIN_SPLITS))

    def cost(s: int) -> tuple[float, int]:
        waves = -(-batch * s // num_sms)
        return waves * (-(-num_blocks // s) + 1) + (merge_cost * batch * s if s > 1 else 0.0), s

    return min(range(1, max(num_blocks, 1) + 1), key=cost)


@functools.lru_cache(maxsize=256)
def h16_min_blocks(batch: int, num_blocks: int, num_sms: int) -> int:
    """Live blocks per split of the 16-head wgmma kernel's queries (the launch: `batch` queries of `num_blocks`
    configured blocks): a query with n live blocks runs on n // h16_min_blocks of the launch's splits (at least 1;
    `gluon_kernel._split_share`). The launch's split count comes from the list's configured width (shapes only),
    and a list configured wide may hold few live rows: SGLang's ratio-128 list is context / 128 entries wide at
    every request (2 + 128 blocks at 1M; 3 live for a request under 8K tokens, where the plan's 2 splits at B = 64
    gave [0, 2) and [2, 3) and one split of 3 measured faster). The value is half the fewest blocks
    `choose_splits` splits `batch` queries at, so a query splits from where (odd: one block before) `choose_splits`
    would first split its live blocks: 4 at B = 64 (it first splits 8 blocks), 1 where it splits any 2 blocks, and
    1 up to B x FUSED_MERGE_MIN_SPLITS CTAs on the SMs (there the merge is in-kernel and every live block on its own
    split measured faster)."""
    if batch * FUSED_MERGE_MIN_SPLITS <= num_sms:
        return 1  # H100, B = 32, 3 live blocks of 130: 3 splits 15.2 us, 1 split 16.6
    for n in range(2, num_blocks + 1):  # the launch's num_blocks splits, so the search ends by it
        if choose_splits(batch, n, num_sms) > 1:
            return n // 2  # n // it is 2 from n on, 1 below n - 1
    return max(num_blocks, 1)


def gluon_splits(config: LaunchConfig, batch: int, num_blocks: int, num_sms: int, is_fp8: bool) -> int:
    """Splits per query of a Gluon launch: config.num_splits, else `choose_splits` (fused merge unless the
    config turns it off; bf16 rows with GLUON_BF16_MERGE_COST)."""
    return config.num_splits or choose_splits(batch, num_blocks, num_sms, fused=config.fused_merge is not False,
                                              merge_cost=MERGE_COST if is_fp8 else GLUON_BF16_MERGE_COST)
