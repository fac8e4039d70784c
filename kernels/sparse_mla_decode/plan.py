"""A sparse-decode call's whole launch, resolved once from its shapes: `plan_launch`.

Class (the dispatch table's row for the device), backend (Gluon or Triton, with the reasons Gluon cannot take a
call in `config`), the kernel (the mma.sync backend's one-block or paired kernel), block and stages, head groups
(programs of `head_group` heads on grid axis 2, where the table sets it), splits per query, whether the Gluon kernel
merges them itself and otherwise which merge kernel runs after it, and every launch keyword. Shapes, dtypes and the
device only (never tensor values), so a plan is cached and a call stays CUDA-graph capturable; `launch.py` only
allocates the outputs and launches what the plan says.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .. import dispatch
from . import checks
from .config import (DIM, PV_REGS, SMEM_LIMIT, LaunchConfig, _num_sms, choose_backend, choose_backend_for,
                     gluon_index_blocks, gluon_smem_bytes, h16_smem_bytes, triton_next_pow2)
from .fp8_layout import PageGeometry
from .splits import MMA_V2_16_HEAD_CTAS_PER_SM, choose_splits, fuses_merge, gluon_splits, h16_min_blocks


ONESHOT_MERGE_FROM = 8  # splits from which the one-shot merge is used (measured, see `_merge_plan`)
# At 16 heads the streaming merge has B x 2 programs: too few (H100, mma.sync kernel, c128 at 8K, 16 real heads,
# graph: B = 24, 6 splits 18.8 us with it against 8 splits 15.2 with the one-shot merge; B = 1, 16.6 against 13.4)
ONESHOT_MERGE_FROM_16_HEADS = 2


@dataclass(frozen=True)
class MergePlan:
    """The merge kernel that runs after a split launch whose kernel does not merge its splits itself."""

    oneshot: bool           # `kernel._combine_kernel` (all splits at once); else `_combine_stream_kernel`
    grid: tuple[int, ...]
    kwargs: dict
    max_shared: int | None  # the class's shared memory per block (None on CPU)


@dataclass(frozen=True)
class LaunchPlan:
    backend: str            # "triton" | "gluon" | "gluon_h16" | "gluon_mma_v2"
    config: LaunchConfig    # resolved: block_n, num_stages, head_group filled in
    grid: tuple[int, ...]   # Triton: (B, splits, head groups); Gluon (all three): (B, splits)
    splits: int
    fused_merge: bool       # Gluon merges the splits in-kernel (else `merge` runs after it)
    kwargs: dict            # the kernel's constexprs and launch options
    pairs: bool = False     # mma.sync: the kernel taking two blocks at a time (gluon_mma_v2_pair.py)
    max_shared: int | None = None   # the class's shared memory per block, for launches that opt into it
    merge: MergePlan | None = None  # the merge kernel's launch (split, not merged in the kernel)


@functools.lru_cache(maxsize=1024)
def plan_launch(device: torch.device, b: int, h: int, dtype: torch.dtype, is_fp8: bool, config: LaunchConfig,
                w: int, k: int, flags: tuple[bool, bool, bool, bool], geos: tuple[PageGeometry, PageGeometry],
                sms: int) -> LaunchPlan:
    """The launch of a call of B queries, h heads, w window and k extra indices per query. flags: (has extra
    cache, window lens, extra lens, sink); geos: the fp8 page geometry of the window and extra caches; sms: the
    device's SM count (the split choice spreads B x splits programs over them)."""
    p = _kernel_plan(device, b, h, dtype, is_fp8, config, w, k, flags, geos, sms)
    gpu = dispatch.class_of_device(device)
    cap = None if gpu is None else dispatch.SMEM_PER_BLOCK[gpu]
    merge = _merge_plan(b, h, p.splits, flags[3], cap) if p.splits > 1 and not p.fused_merge else None
    return replace(p, max_shared=cap if p.backend in ("triton", "gluon_mma_v2") else None, merge=merge)


def _kernel_plan(device, b, h, dtype, is_fp8, config, w, k, flags, geos, sms) -> LaunchPlan:
    """The kernel's part of `plan_launch`: backend, config, grid, splits and constexprs."""
    asked = config
    backend, config = choose_backend_for(device, h, dtype, is_fp8, config, w, k)
    if asked.backend == "auto" and b < _min_batch(device, h):  # the row's fallback, where it measured faster
        backend, config = choose_backend_for(device, h, dtype, is_fp8, asked, w, k, use_fallback=True)
    if backend == "gluon":
        splits, fuse, kwargs = _gluon_plan(b, w, k, is_fp8, config, sms, flags, geos)
        return LaunchPlan("gluon", config, (b, splits), splits, fuse, kwargs)
    if backend == "gluon_h16":
        splits, kwargs = _h16_plan(b, w, k, is_fp8, config, sms, flags, geos)
        return LaunchPlan("gluon_h16", config, (b, splits), splits, kwargs["FUSE_MERGE"], kwargs)
    if backend == "gluon_mma_v2":
        splits, kwargs = _mma_v2_plan(b, h, w, k, is_fp8, config, sms, flags, geos)
        pairs = _pairs(config, h, is_fp8, flags[0], geos, -(-w // config.block_n) + -(-k // config.block_n), splits)
        return LaunchPlan("gluon_mma_v2", config, (b, splits), splits, False, kwargs, pairs)
    groups = h // config.head_group if config.head_group and h > config.head_group else 1
    dot_f32 = dtype == torch.float32 or device.type != "cuda"
    splits, kwargs = _triton_plan(b, h // groups, w, k, is_fp8, config, sms, flags, geos, dot_f32)
    return LaunchPlan("triton", config, (b, splits, groups), splits, False, kwargs)


def _merge_plan(b: int, h: int, splits: int, has_sink: bool, max_shared: int | None) -> MergePlan:
    """From ONESHOT_MERGE_FROM splits on (from 2 at 16 heads): programs over (query, head group, 64-dim chunk), each
    loading all its splits at once (one L2 round trip); below: programs over (query, 8 heads) streaming the splits.
    The thresholds are measured (H200, bench/results/sparse_decode.md; 16 heads on an H100, DEVELOPERS.md): each is
    the faster on its side."""
    sp = triton_next_pow2(splits)
    if splits < (ONESHOT_MERGE_FROM_16_HEADS if h <= 16 else ONESHOT_MERGE_FROM):
        hb = min(8, h)
        return MergePlan(False, (b, h // hb), dict(H=h, D=DIM, HB=hb, SP=sp, HAS_SINK=has_sink, num_warps=4),
                         max_shared)
    hb = max(1, min(8, h, 8192 // (sp * 64)))
    return MergePlan(True, (b, h // hb, DIM // 64),
                     dict(H=h, D=DIM, HB=hb, DC=64, SP=sp, HAS_SINK=has_sink, num_warps=4), max_shared)


@functools.lru_cache(maxsize=256)
def dense_config(device: torch.device, batch: int, nominal_rows: int, heads: int, dtype: torch.dtype) -> LaunchConfig:
    """The config of the embedded engine's ratio-128 (dense) calls: the table's dense backend with its class's block,
    and splits as for `nominal_rows` rows a query at this batch size (shapes only: graph-capturable, the same at every
    step of a configured context)."""
    triton = LaunchConfig(backend=dispatch.DENSE_DECODE_BACKEND)
    block = choose_backend(device, heads, dtype, True, triton)[1].block_n  # the class's Triton block
    return replace(triton, block_n=block, num_splits=choose_splits(batch, -(-nominal_rows // block), _num_sms(device)))


def _min_batch(device: torch.device, h: int) -> int:
    """The smallest batch the dispatch table's row for (the device's class, h) runs its own kernel at (below it, the
    row's fallback: where it measured slower)."""
    gpu = dispatch.class_of_device(device)
    return dispatch.decode_impl(gpu, h).min_batch if gpu is not None and h in (16, 32, 64) else 1


def _geometry_kwargs(geos: tuple[PageGeometry, PageGeometry]) -> dict:
    """The fp8 page geometry constexprs of both kernels: window and extra cache (log2 tokens, stride)."""
    w, e = geos
    return dict(W_SHIFT=w.shift, W_PAGE=w.page_stride, E_SHIFT=e.shift, E_PAGE=e.page_stride)


def _triton_plan(b, h, w, k, is_fp8, config, sms, flags, geos, dot_f32):
    """(splits, launch keyword arguments) of the Triton kernel, h heads per program."""
    bn = config.block_n
    num_blocks = -(-w // bn) + -(-k // bn)
    splits = config.num_splits or choose_splits(b, num_blocks, sms)
    has_extra, has_wlen, has_elen, has_sink = flags
    return splits, dict(H=h, D=DIM, BN=bn, SPLIT_OUT=splits > 1, IS_FP8=is_fp8, HAS_EXTRA=has_extra,
                        HAS_WLEN=has_wlen, HAS_ELEN=has_elen, HAS_SINK=has_sink, DOT_F32=dot_f32,
                        PREFETCH=config.prefetch, **_geometry_kwargs(geos), num_warps=config.num_warps,
                        num_stages=config.num_stages)


def _pairs(config, h: int, is_fp8: bool, has_extra: bool, geos, num_blocks: int, splits: int) -> bool:
    """Whether the mma.sync launch takes its blocks two at a time (gluon_mma_v2_pair.py): 64 heads on 8 warps, fp8
    rows in words (as compiled for sm_120a it spills at 16 warps and on bytes), config.pair_min_blocks blocks a split
    or more, and an extra cache of 64 entries a page or more: SGLang's ratio-4 cache, whose 512-entry top-k list is
    full from 2K tokens on. The ratio-128 list (2 entries a 256-token page) is context / 128 entries wide whatever is
    live, and with few live blocks a pair's fixed cost and an odd count's empty half lose (9 live: 39.1 against 37.1
    us, H100 standing in); a window-only call (no extra cache) stays on the one-block kernel too."""
    floor = config.pair_min_blocks or 0
    return (floor > 0 and (h, config.num_warps) == (64, 8) and is_fp8 and bool(config.fp8_words) and has_extra
            and geos[1].page_tokens >= 64 and -(-num_blocks // splits) >= floor)


def _mma_v2_plan(b, h, w, k, is_fp8, config, sms, flags, geos):
    """(splits, launch keyword arguments) of the mma.sync Gluon kernel; its merge is the Triton kernel's."""
    bn = config.block_n
    warps = (4, 8) if h == 16 else (8, 16)  # 64 heads: 4 warps would hold all of O's 512 columns a warp
    if (bn, config.num_stages) != (16, 2) or config.num_warps not in warps:
        raise checks.SparseDecodeInputError(
            "the mma.sync Gluon kernel takes block_n 16, num_stages 2 (Q and two row stages fill sm_120's 99 KB) "
            f"and num_warps {' or '.join(map(str, warps))} at {h} heads; got {bn}, {config.num_stages}, "
            f"{config.num_warps}")
    slots = sms * (MMA_V2_16_HEAD_CTAS_PER_SM if h == 16 else 1)  # CTAs resident at once
    splits = config.num_splits or choose_splits(b, -(-w // bn) + -(-k // bn), slots)
    has_extra, has_wlen, has_elen, has_sink = flags
    return splits, dict(H=h, BN=bn, SPLIT_OUT=splits > 1, IS_FP8=is_fp8, HAS_EXTRA=has_extra, HAS_WLEN=has_wlen,
                        HAS_ELEN=has_elen, HAS_SINK=has_sink, **_geometry_kwargs(geos), WORDS=bool(config.fp8_words),
                        LAZY=bool(config.lazy_rescale), num_warps=config.num_warps)


def _h16_plan(b, w, k, is_fp8, config, sms, flags, geos):
    """(splits, launch keyword arguments) of the 16-head wgmma Gluon kernel: one CTA an SM (its stages need
    ~150 KB), splits from `choose_splits`, merged in the kernel by the last split of a query to finish (no
    cooperative launch needed; `LaunchConfig(fused_merge=False)`: by the merge kernel after it)."""
    bn, stages = config.block_n, config.num_stages
    smem = h16_smem_bytes(bn, stages, w, k)
    if bn != 64 or stages < 2 or config.loader_warps not in (4, 8) or smem > SMEM_LIMIT:
        raise checks.SparseDecodeInputError(
            f"the 16-head Gluon kernel takes block_n 64 (wgmma's M), num_stages >= 2 within {SMEM_LIMIT} B of shared "
            f"memory and 4 or 8 loader warps; got {bn}, {stages} ({smem} B), {config.loader_warps}")
    num_blocks = -(-w // bn) + -(-k // bn)
    splits = config.num_splits or choose_splits(b, num_blocks, sms)
    has_extra, has_wlen, has_elen, has_sink = flags
    fuse = splits > 1 and config.fused_merge is not False
    return splits, dict(BN=bn, NS=stages, SPLIT_OUT=splits > 1, FUSE_MERGE=fuse, IS_FP8=is_fp8, HAS_EXTRA=has_extra,
                        HAS_WLEN=has_wlen, HAS_ELEN=has_elen, HAS_SINK=has_sink, **_geometry_kwargs(geos),
                        LOADER_WARPS=config.loader_warps, LOADER_REGS=config.loader_regs,
                        MAXB=gluon_index_blocks(w, k, bn),
                        min_per=h16_min_blocks(b, num_blocks, sms) if splits > 1 else 1, num_warps=4)


def _gluon_plan(b, w, k, is_fp8, config, sms, flags, geos):
    """(splits, fused merge?, launch keyword arguments) of the Gluon kernel."""
    from . import gluon_epilogue

    bn = config.block_n
    if bn not in (32, 64) or config.num_stages < 2:
        raise checks.SparseDecodeInputError(
            f"the Gluon kernel takes block_n 32 or 64 and num_stages >= 2; got {bn}, {config.num_stages}")
    smem = gluon_smem_bytes(bn, config.num_stages, w, k)
    if smem > SMEM_LIMIT:
        raise checks.SparseDecodeInputError(
            f"block_n={bn} with {config.num_stages} stages needs {smem} B of shared memory, over the "
            f"{SMEM_LIMIT} B a block may use (window {w} + extra {k} indices per query): use fewer stages "
            "or block_n=32")
    num_blocks = -(-w // bn) + -(-k // bn)
    splits = gluon_splits(config, b, num_blocks, sms, is_fp8)
    fuse = fuses_merge(config, b, splits, sms)
    sp, mht, mdc = gluon_epilogue.fused_merge_tile(splits) if fuse else (1, 1, 64)
    has_extra, has_wlen, has_elen, has_sink = flags
    return splits, fuse, dict(
        BN=bn, NS=config.num_stages, SPLIT_OUT=splits > 1, IS_FP8=is_fp8, HAS_EXTRA=has_extra,
        HAS_WLEN=has_wlen, HAS_ELEN=has_elen, HAS_SINK=has_sink, **_geometry_kwargs(geos), LOADER_WARPS=4,
        LOADER_REGS=config.loader_regs, PV_REGS=PV_REGS, MAXB=gluon_index_blocks(w, k, bn), FUSE_MERGE=fuse,
        SP=sp, MHT=mht, MDC=mdc, EARLY_TABLE=(fuse and not is_fp8) if config.early_table is None else
        config.early_table, num_warps=4, launch_cooperative_grid=fuse)
