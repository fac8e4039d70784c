"""Warp-specialised sparse MLA decode for Hopper, written in Gluon (Triton's explicit-layout dialect).

Why a second kernel beside `kernel.py`: the plain-Triton kernel runs one 8-warp program per SM whose
every 64-row block is a serial chain (gather -> QK^T -> softmax -> PV); ncu saw 12% occupancy and no
overlap. Here one CTA per (query, split) has three partitions that run concurrently:

    loader      (4 warps, gluon_loaders.py) first stages every live block's indices, then Q, in shared
                memory (one round trip; it waits for the indices only), then per block fills stage
                i % NS: bf16 rows by cp.async; V4 fp8 records loaded into registers (the next half-block in flight), dequantised there and
                stored as bf16. Signals `full[s]`.
    compute S   (warpgroup 0, the default partition) S = Q K^T of the block (the only QK^T: computing
                it in both warpgroups doubled the tensor cores' shared-memory reads, measured 50.0 vs
                44.2 us at B=128 bf16), the online softmax, P and the rescale of O into shared memory
                for warpgroup 1 (`pready`), then P V on O[:, 0:256].
    compute PV  (warpgroup 1) O[:, 256:512] += P V with P read from shared memory (`pfree` when done).
                Both compute warpgroups arrive on `empty[s]`; the softmax statistics reach warpgroup 1
                at the end (`lready`) for its normalisation.
    epilogue    each compute warpgroup stores its half of O. Unsplit, through its own shared memory, free by
                then (Q's for warpgroup 0, the row stages' for warpgroup 1) and whole-row 16-byte stores
                (`_store_rows`); split partials (fp32) straight from the accumulator layout.

All 64 heads of the query are the M = 64 of every wgmma, so each selected row is read from memory
once. Work is O(live rows): the split's block range comes from the per-query lengths, nothing is
sized by the cache. No host syncs: graph-capturable like `kernel.py`. Splits are merged inside the
kernel when all B x splits CTAs fit on the SMs at once (`gluon_epilogue._merge_splits`, a cooperative
launch: each split waits for its query's others on a counter, then merges a share of the heads), else by
`kernel._combine_kernel` / `_combine_stream_kernel` after it (see plan._merge_plan).

Semantics are those of `reference.py`; this file only runs on sm_90 (the tests and the benchmark
compare it with the reference there). Block indices: live block j < nbw is window block j, else extra
block j - nbw, exactly as in `kernel.py`. Measurements and what was tried: bench/results/sparse_decode.md.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_epilogue import _early_sink, _epilogue, _out_buf
from .gluon_loaders import D_ALL, H_ALL, _table_row, loader_partition, stage_q_and_indices


@gluon.jit
def _split_share(nlive, num_splits, min_per, FLOOR: gl.constexpr):
    """Blocks per split of a query with `nlive` live blocks: spread over the launch's splits; with FLOOR over
    nlive // min_per of them (at least 1, at most the launch's): a few live rows in a list configured wide stay
    on fewer splits and the rest exit without rows (`splits.h16_min_blocks`)."""
    if FLOOR:
        num_splits = gl.maximum(gl.minimum(nlive // min_per, num_splits), 1)
    return (nlive + num_splits - 1) // num_splits


@gluon.jit
def _block_range(b, split, num_splits, W, K, wlen_ptr, elen_ptr, BN: gl.constexpr,
                 HAS_EXTRA: gl.constexpr, HAS_WLEN: gl.constexpr, HAS_ELEN: gl.constexpr, min_per,
                 FLOOR: gl.constexpr):
    """(lo, hi, nbw, wlen, elen): this split's live blocks [lo, hi) (`_split_share` each, from split 0) and the
    query's lengths."""
    wlen = W
    if HAS_WLEN:
        wlen = gl.minimum(gl.maximum(gl.load(wlen_ptr + b), 0), W)
    elen = 0
    if HAS_EXTRA:
        elen = K
        if HAS_ELEN:
            elen = gl.minimum(gl.maximum(gl.load(elen_ptr + b), 0), K)
    nbw = (wlen + BN - 1) // BN
    nlive = nbw + (elen + BN - 1) // BN
    per_split = _split_share(nlive, num_splits, min_per, FLOOR)
    lo = split * per_split
    if FLOOR:
        lo = gl.minimum(lo, nlive)  # a split past the live blocks starts at their end: lo <= hi
    hi = gl.minimum(lo + per_split, nlive)
    return lo, hi, nbw, wlen, elen


@gluon.jit
def _online_softmax(sc, j, nbw, wlen, elen, idx_s, m_i, l_i, qk_scale_log2, offs_c, BN: gl.constexpr):
    """Mask block j's raw scores, fold them into (m_i, l_i); P in bf16 (S's layout), the O rescale, m, l."""
    is_w = j < nbw
    blk = gl.where(is_w, j, j - nbw)
    n_valid = gl.where(is_w, wlen, elen)
    valid = (idx_s >= 0) & (blk * BN + offs_c < n_valid)
    sc = gl.where(valid[None, :], sc * qk_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sc - m_safe[:, None])
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p.to(gl.bfloat16), alpha, m_new, l_new


@gluon.jit
def _compute_s(b, split, num_splits, lo, hi, nbw, nbw_t, wlen, elen, qk_scale_log2,
               sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
               q_smem, k_smem, idx_all, p_smem, row_smem, q_bar, full, empty, pready, pfree, lready, counter_ptr,
               BN: gl.constexpr, NS: gl.constexpr, SPLIT_OUT: gl.constexpr, HAS_SINK: gl.constexpr,
               FUSE_MERGE: gl.constexpr, SP: gl.constexpr, MHT: gl.constexpr, MDC: gl.constexpr):
    """Warpgroup 0 (the default partition): S = Q K^T over all 512 dims (the only QK^T of a block), the
    online softmax, P and the rescale factor handed to warpgroup 1 through shared memory, then P V on
    O[:, 0:256]. At the end the softmax statistics go to warpgroup 1 the same way."""
    DH: gl.constexpr = D_ALL // 2
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)

    m_i = gl.full([H_ALL], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([H_ALL], gl.float32, layout=row_s)
    acc = gl.zeros([H_ALL, DH], gl.float32, layout=o_l)
    sink = _early_sink(sink_ptr, row_s, SPLIT_OUT, HAS_SINK)
    s_zero = gl.zeros([H_ALL, BN], gl.float32, layout=s_l)
    offs_c = gl.arange(0, BN, layout=col_s)
    mbarrier.wait(q_bar, 0)
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        pb = i % 2
        mbarrier.wait(full.index(s), (i // NS) & 1)
        fence_async_shared()
        k = k_smem.index(s)
        sc = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        idx_s = idx_all.index(_table_row(j, nbw, nbw_t)).load(col_s)
        p, alpha, m_i, l_i = _online_softmax(sc, j, nbw, wlen, elen, idx_s,
                                             m_i, l_i, qk_scale_log2, offs_c, BN)
        if i >= 2:  # warpgroup 1 is done with this P buffer's previous block
            mbarrier.wait(pfree.index(pb), ((i // 2) + 1) & 1)
        p_smem.index(pb).store(p)
        p_op = gl.convert_layout(p, p_l)
        row_smem.index(pb).store(alpha)
        fence_async_shared()  # P is read by warpgroup 1's wgmma (async proxy)
        gl.barrier()
        mbarrier.arrive(pready.index(pb))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(p_op, k.slice(0, DH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s))
    row_smem.index(2).store(m_i)
    row_smem.index(3).store(l_i)
    gl.barrier()
    mbarrier.arrive(lready)
    # Q is read no more (the last S is done): its 64 KB stage this warpgroup's half of O
    _epilogue(acc, m_i, l_i, sink, b, split, num_splits, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
              part_o_ptr, part_lse_ptr, counter_ptr, _out_buf(q_smem, 2), o_l, row_s, 0, SPLIT_OUT, HAS_SINK, FUSE_MERGE,
              SP, MHT, MDC)


@gluon.jit
def _compute_pv(b, split, num_splits, lo, hi, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
                part_o_ptr, part_lse_ptr, k_smem, p_smem, row_smem, full, empty, pready, pfree, lready, counter_ptr,
                BN: gl.constexpr, NS: gl.constexpr, SPLIT_OUT: gl.constexpr, HAS_SINK: gl.constexpr,
                FUSE_MERGE: gl.constexpr, SP: gl.constexpr, MHT: gl.constexpr, MDC: gl.constexpr):
    """Warpgroup 1: O[:, 256:512] += P V with P (and the rescale of O) from warpgroup 0's shared memory."""
    DH: gl.constexpr = D_ALL // 2
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    acc = gl.zeros([H_ALL, DH], gl.float32, layout=o_l)
    sink = _early_sink(sink_ptr, row_s, SPLIT_OUT, HAS_SINK)
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        pb = i % 2
        mbarrier.wait(full.index(s), (i // NS) & 1)
        mbarrier.wait(pready.index(pb), (i // 2) & 1)
        alpha = row_smem.index(pb).load(row_o)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem.index(pb), k_smem.index(s).slice(DH, DH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(pfree.index(pb))
        mbarrier.arrive(empty.index(s))
    mbarrier.wait(lready, 0)
    m_i = row_smem.index(2).load(row_s)
    l_i = row_smem.index(3).load(row_s)
    # lready: warpgroup 0 is past its last S, and this one past its last P V, so no block is read any more
    # and the loader has nothing in flight: the row stages stage this warpgroup's half of O
    _epilogue(acc, m_i, l_i, sink, b, split, num_splits, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
              part_o_ptr, part_lse_ptr, counter_ptr, _out_buf(k_smem, NS * BN // 32), o_l, row_s, 1, SPLIT_OUT, HAS_SINK, FUSE_MERGE,
              SP, MHT, MDC)


@gluon.jit
def _sparse_decode_ws_kernel(
    q_ptr, stride_qb, stride_qh,
    kv_ptr, stride_kv, ekv_ptr, stride_ekv,
    widx_ptr, stride_wb, W, eidx_ptr, stride_eb, K,
    wlen_ptr, elen_ptr, sink_ptr,
    out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
    part_o_ptr, part_lse_ptr, counter_ptr,
    qk_scale_log2, num_splits,
    BN: gl.constexpr, NS: gl.constexpr, SPLIT_OUT: gl.constexpr,
    IS_FP8: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_WLEN: gl.constexpr, HAS_ELEN: gl.constexpr,
    HAS_SINK: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr,
    LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, PV_REGS: gl.constexpr, MAXB: gl.constexpr,
    FUSE_MERGE: gl.constexpr = False, SP: gl.constexpr = 1, MHT: gl.constexpr = 1, MDC: gl.constexpr = 64,
    EARLY_TABLE: gl.constexpr = False,
):
    # FUSE_MERGE (a cooperative launch, SPLIT_OUT): the splits merge themselves at the end (_merge_splits);
    # SP, MHT, MDC: its tile (fused_merge_tile). EARLY_TABLE: Q and the index table are staged by
    # the body before the per-query lengths are loaded (launch: bf16 with the fused merge, where the kernel is
    # short and that round trip shows; on fp8 it measured slower at every B, see LaunchConfig.early_table).
    b = gl.program_id(0)
    split = gl.program_id(1)
    if not EARLY_TABLE:
        lo, hi, nbw, wlen, elen = _block_range(b, split, num_splits, W, K, wlen_ptr, elen_ptr, BN,
                                               HAS_EXTRA, HAS_WLEN, HAS_ELEN, 1, False)

    nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [H_ALL, D_ALL], nvmma)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, D_ALL], nvmma)
    idx_all = gl.allocate_shared_memory(gl.int32, [MAXB, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, H_ALL, BN],
                                       gl.NVMMASharedLayout.get_default_for([H_ALL, BN], gl.bfloat16))
    # rows 0-1: the O rescale of the block in P buffer 0 / 1; rows 2-3: the final softmax max and sum
    row_smem = gl.allocate_shared_memory(gl.float32, [4, H_ALL], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    t_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # the index table has landed
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # Q has landed
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    lready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    stagers: gl.constexpr = (gl.num_warps() if EARLY_TABLE else LOADER_WARPS) * 32  # threads staging table and Q
    mbarrier.init(t_bar, count=stagers)
    mbarrier.init(q_bar, count=stagers)
    for s in gl.static_range(NS):
        # bf16: one cp.async arrive per loader thread; fp8: one plain arrive after the dequantisation.
        mbarrier.init(full.index(s), count=1 if IS_FP8 else LOADER_WARPS * 32)
        mbarrier.init(empty.index(s), count=2)
    for h in gl.static_range(2):
        mbarrier.init(pready.index(h), count=1)
        mbarrier.init(pfree.index(h), count=1)
    mbarrier.init(lready, count=1)

    if EARLY_TABLE:
        # Q and the index table (laid out by W and K: window block r in row r, extra block r in row
        # ceil(W / BN) + r) go out first, from these 4 warps, so that their round trip overlaps the load
        # of the per-query lengths below, which the table would otherwise wait for.
        gl.barrier()  # the barriers' inits are seen by every thread that arrives on them
        stage_q_and_indices(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b,
                            (W + BN - 1) // BN, W, K, q_smem, idx_all, t_bar, q_bar, MAXB, BN)
        lo, hi, nbw, wlen, elen = _block_range(b, split, num_splits, W, K, wlen_ptr, elen_ptr, BN,
                                               HAS_EXTRA, HAS_WLEN, HAS_ELEN, 1, False)
    nbw_t = (W + BN - 1) // BN if EARLY_TABLE else nbw  # the table's window blocks (`_table_row`)

    # Registers: the loader and the P V warpgroup get what they ask for, warpgroup 0 the rest.
    gl.warp_specialize([
        (_compute_s, (b, split, num_splits, lo, hi, nbw, nbw_t, wlen, elen, qk_scale_log2,
                      sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
                      q_smem, k_smem, idx_all, p_smem, row_smem, q_bar, full, empty, pready, pfree, lready,
                      counter_ptr, BN, NS, SPLIT_OUT, HAS_SINK, FUSE_MERGE, SP, MHT, MDC)),
        (_compute_pv, (b, split, num_splits, lo, hi, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
                       part_o_ptr, part_lse_ptr, k_smem, p_smem, row_smem, full, empty, pready, pfree, lready,
                       counter_ptr, BN, NS, SPLIT_OUT, HAS_SINK, FUSE_MERGE, SP, MHT, MDC)),
        (loader_partition, (q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                            widx_ptr, stride_wb, eidx_ptr, stride_eb, b, lo, hi, nbw, nbw_t, wlen, elen,
                            q_smem, k_smem, idx_all, t_bar, q_bar, full, empty,
                            BN, NS, MAXB, IS_FP8, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE, EARLY_TABLE)),
    ], [4, LOADER_WARPS], [PV_REGS, LOADER_REGS])
