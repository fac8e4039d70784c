"""Warp-specialised sparse MLA decode for Hopper, written in Gluon (Triton's explicit-layout dialect).

Why a second kernel beside `kernel.py`: the plain-Triton kernel runs one 8-warp program per SM whose
every 64-row block is a serial chain (gather -> QK^T -> softmax -> PV); ncu saw 12% occupancy and no
overlap. Here one CTA per (query, split) has three partitions that run concurrently:

    loader      (4 warps)  first stages Q and every live block's indices in shared memory (one round
                           trip), then per block: bf16 rows are gathered with cp.async straight into
                           stage i % NS; V4 fp8 records are cp.async'd into NR raw staging buffers
                           (NR - 1 blocks in flight) and dequantised from there into the bf16 stage.
                           Signals `full[s]`.
    compute 0/1 (4 warps each) each owns half of the output dims (O[:, 0:256] / O[:, 256:512], a
                           [64, 256] fp32 accumulator per warpgroup). By default both compute the whole
                           S = Q K^T of a block (neither waits on the other, at 1.5x the minimal
                           tensor-core work); with XCH each computes S over its 256 dims and the halves
                           are swapped through shared memory (measured slower on the H200). Both run the
                           same online softmax, then P V on their half; each arrives on `empty[s]`.

All 64 heads of the query are the M = 64 of every wgmma, so each selected row is read from memory
once. Work is O(live rows): the split's block range comes from the per-query lengths, nothing is
sized by the cache. No host syncs: graph-capturable like `kernel.py`; splits are merged by
`kernel._combine_kernel` / `_combine_stream_kernel` (see launch._combine).

Semantics are those of `reference.py`; this file only runs on sm_90 (the tests and the benchmark
compare it with the reference there). Block indices: live block j < nbw is window block j, else extra
block j - nbw, exactly as in `kernel.py`. Measurements and what was tried: bench/results/sparse_decode.md.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

H_ALL = gl.constexpr(64)
D_ALL = gl.constexpr(512)


@gluon.jit
def _block_range(b, split, num_splits, W, K, wlen_ptr, elen_ptr, BN: gl.constexpr,
                 HAS_EXTRA: gl.constexpr, HAS_WLEN: gl.constexpr, HAS_ELEN: gl.constexpr):
    """(lo, hi, nbw, wlen, elen): this split's live blocks [lo, hi) and the query's lengths."""
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
    per_split = (nlive + num_splits - 1) // num_splits
    lo = split * per_split
    hi = gl.minimum(lo + per_split, nlive)
    return lo, hi, nbw, wlen, elen


@gluon.jit
def _stage_indices(idx_all, widx_row, eidx_row, nbw, wlen, elen, MAXB: gl.constexpr, BN: gl.constexpr):
    """cp.async every live block's indices into idx_all [MAXB, BN]: row j = live block j (window blocks,
    then extra blocks), zeros past the lengths (readers mask by position). One round trip for all of them,
    so no block waits on an index load before its rows can be gathered."""
    NW: gl.constexpr = gl.num_warps()
    l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BN // 4), BN // 4], [NW, 1], [1, 0])
    jr = gl.arange(0, MAXB, layout=gl.SliceLayout(1, l))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, l))
    is_w = jr < nbw
    blk = gl.where(is_w, jr, jr - nbw)
    n_valid = gl.where(is_w, wlen, elen)
    pos = blk[:, None] * BN + c[None, :]
    ptrs = gl.where(is_w[:, None], widx_row + pos, eidx_row + pos)
    # idx_all is allocated with a rank-1 layout (so that .index(j) gives block j); the 2-D copy needs
    # the same unswizzled row-major bytes seen through a rank-2 layout.
    table = idx_all._reinterpret(gl.int32, [MAXB, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    async_copy.async_copy_global_to_shared(table, ptrs, mask=(pos >= 0) & (pos < n_valid[:, None]))


@gluon.jit
def _block_rows(idx_all, j, hi, nbw, wlen, elen, offs_n, MAXB: gl.constexpr, BN: gl.constexpr):
    """Cache rows of live block j from the staged table (-1 where invalid or past the length; all -1 for j >= hi)."""
    is_w = j < nbw
    blk = gl.where(is_w, j, j - nbw)
    n_valid = gl.where(j < hi, gl.where(is_w, wlen, elen), 0)
    idx = idx_all.index(gl.minimum(j, MAXB - 1)).load(offs_n.type.layout)
    return gl.where(blk * BN + offs_n < n_valid, idx, -1)


@gluon.jit
def _stage_q_and_indices(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen, elen,
                         q_smem, idx_all, q_bar, rows_l: gl.constexpr, MAXB: gl.constexpr, BN: gl.constexpr):
    """Loader prologue: Q (64 heads x 512 dims) and the index table by cp.async, tracked by q_bar, which
    the loader then waits on too (it reads the table)."""
    qh = gl.arange(0, H_ALL, layout=gl.SliceLayout(1, rows_l))
    qd = gl.arange(0, D_ALL, layout=gl.SliceLayout(0, rows_l))
    q_ptrs = q_ptr + b.to(gl.int64) * stride_qb + qh[:, None] * stride_qh + qd[None, :]
    async_copy.async_copy_global_to_shared(q_smem, q_ptrs)
    widx_row = widx_ptr + b.to(gl.int64) * stride_wb
    eidx_row = eidx_ptr + b.to(gl.int64) * stride_eb
    _stage_indices(idx_all, widx_row, eidx_row, nbw, wlen, elen, MAXB, BN)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)
    mbarrier.wait(q_bar, 0)


@gluon.jit
def _loader(q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
            widx_ptr, stride_wb, eidx_ptr, stride_eb,
            b, lo, hi, nbw, wlen, elen,
            q_smem, k_smem, idx_all, q_bar, full, empty,
            BN: gl.constexpr, NS: gl.constexpr, MAXB: gl.constexpr,
            PAGE_STRIDE: gl.constexpr, SCALES_OFFSET: gl.constexpr, PROBE: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    _stage_q_and_indices(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen, elen,
                         q_smem, idx_all, q_bar, rows_l, MAXB, BN)

    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, rows_l))
    offs_d = gl.arange(0, D_ALL, layout=gl.SliceLayout(0, rows_l))
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        idx = _block_rows(idx_all, j, hi, nbw, wlen, elen, offs_n, MAXB, BN)
        if i >= NS:  # wait until both compute warpgroups are done with this stage's previous block
            mbarrier.wait(empty.index(s), ((i // NS) + 1) & 1)
        valid = idx >= 0
        base = gl.where(j < nbw, kv_ptr, ekv_ptr)
        stride = gl.where(j < nbw, stride_kv, stride_ekv)
        ptrs = base + idx.to(gl.int64)[:, None] * stride + offs_d[None, :]
        if PROBE != 2:
            async_copy.async_copy_global_to_shared(k_smem.index(s), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _issue_raw_fp8(j, hi, nbw, wlen, elen, idx_all, kv_ptr, ekv_ptr, nope_st, rope_st, sc_st,
                   BN: gl.constexpr, MAXB: gl.constexpr, PAGE_STRIDE: gl.constexpr, SCALES_OFFSET: gl.constexpr):
    """cp.async the raw V4 records of live block j (nothing for j >= hi) into one staging buffer; commit.

    nope_st [BN, 8, 64] u8 gets the 448 e4m3 bytes (tile 7 zero-filled), rope_st [BN, 64] bf16 the
    RoPE dims, sc_st [BN, 8] u8 the 7 ue8m0 scales + pad. Invalid rows are zero-filled everywhere.
    """
    NW: gl.constexpr = gl.num_warps()
    nope_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    sc_l: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, nope_l))
    idx = _block_rows(idx_all, j, hi, nbw, wlen, elen, gl.arange(0, BN, layout=row_l), MAXB, BN)
    valid = idx >= 0
    base = gl.where(j < nbw, kv_ptr, ekv_ptr)
    page_base = base + (idx // 64).to(gl.int64) * PAGE_STRIDE
    slot = idx % 64
    rec = page_base + slot * 576
    t = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, nope_l)))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, nope_l)))
    nope_ptrs = rec[:, None, None] + (t[None, :, None] * 64 + c[None, None, :])
    nope_mask = valid[:, None, None] & (t < 7)[None, :, None]
    async_copy.async_copy_global_to_shared(nope_st, nope_ptrs, mask=nope_mask)

    rec_r = gl.convert_layout(rec, gl.SliceLayout(1, rope_l))
    valid_r = gl.convert_layout(valid, gl.SliceLayout(1, rope_l))
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
    rope_ptrs = (rec_r + 448).to(gl.pointer_type(gl.bfloat16), bitcast=True)[:, None] + cr[None, :]
    async_copy.async_copy_global_to_shared(rope_st, rope_ptrs, mask=valid_r[:, None])

    pb_s = gl.convert_layout(page_base, gl.SliceLayout(1, sc_l))
    slot_s = gl.convert_layout(slot, gl.SliceLayout(1, sc_l))
    valid_s = gl.convert_layout(valid, gl.SliceLayout(1, sc_l))
    cs = gl.arange(0, 8, layout=gl.SliceLayout(0, sc_l))
    sc_ptrs = (pb_s + SCALES_OFFSET + slot_s * 8)[:, None] + cs[None, :]
    async_copy.async_copy_global_to_shared(sc_st, sc_ptrs, mask=valid_s[:, None])
    async_copy.commit_group()


@gluon.jit
def _dequant_tiles(nope_st, sc_st, k_stage, T0: gl.constexpr, G: gl.constexpr, BN: gl.constexpr):
    """k_stage[:, 64*T0 : 64*(T0+G)] = e4m3 tiles T0..T0+G-1 of the staged records x 2**(ue8m0 - 127).

    16 bytes per thread and pass: RC = 8 * 4 / G rows per pass of the loader's warps."""
    NW: gl.constexpr = gl.num_warps()
    RC: gl.constexpr = 2 * NW * 4 // G
    deq_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8 // G, G, 4], [NW, 1, 1], [2, 1, 0])
    for r0 in gl.static_range(0, BN, RC):
        raw = nope_st.slice(r0, RC, dim=0).slice(T0, G, dim=1).load(deq_l)
        sc = sc_st.slice(r0, RC, dim=0).slice(T0, G, dim=1).load(gl.SliceLayout(2, deq_l))
        scale = gl.exp2(sc.to(gl.float32) - 127.0)
        vals = raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None]
        k_stage.slice(r0, RC, dim=0).slice(T0 * 64, G * 64, dim=1).store(
            gl.reshape(vals.to(gl.bfloat16), [RC, G * 64]))


@gluon.jit
def _loader_fp8(q_ptr, stride_qb, stride_qh, kv_ptr, ekv_ptr,
                widx_ptr, stride_wb, eidx_ptr, stride_eb,
                b, lo, hi, nbw, wlen, elen,
                q_smem, k_smem, idx_all, nope_st, rope_st, sc_st, q_bar, full, empty,
                BN: gl.constexpr, NS: gl.constexpr, NR: gl.constexpr, MAXB: gl.constexpr,
                PAGE_STRIDE: gl.constexpr, SCALES_OFFSET: gl.constexpr, PROBE: gl.constexpr):
    """V4 fp8 pages: raw records of blocks j+1 .. j+NR-1 are in flight (cp.async into NR staging
    buffers) while block j is dequantised from shared memory into the bf16 stage the wgmmas read."""
    NW: gl.constexpr = gl.num_warps()
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    _stage_q_and_indices(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen, elen,
                         q_smem, idx_all, q_bar, rows_l, MAXB, BN)

    for r in gl.static_range(NR - 1):  # raw records of the first NR - 1 blocks in flight
        _issue_raw_fp8(gl.where(PROBE == 2, hi, lo + r), hi, nbw, wlen, elen, idx_all, kv_ptr, ekv_ptr,
                       nope_st.index(r), rope_st.index(r), sc_st.index(r), BN, MAXB, PAGE_STRIDE, SCALES_OFFSET)
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        cur = i % NR
        nxt = (i + NR - 1) % NR  # read in the previous iteration, released by its closing barrier
        _issue_raw_fp8(gl.where(PROBE == 2, hi, j + NR - 1), hi, nbw, wlen, elen, idx_all, kv_ptr, ekv_ptr,
                       nope_st.index(nxt), rope_st.index(nxt), sc_st.index(nxt), BN, MAXB, PAGE_STRIDE, SCALES_OFFSET)
        async_copy.wait_group(NR - 1)  # this thread's copies of block j have landed ...
        gl.thread_barrier()  # ... and every loader thread's
        if i >= NS:
            mbarrier.wait(empty.index(s), ((i // NS) + 1) & 1)
        if PROBE != 3:
            k_stage = k_smem.index(s)
            # e4m3 tiles 0-3, 4-5 and 6 (448 dims) in three groups, so no element pays a select;
            # the RoPE dims are bf16 already and are copied as they are.
            _dequant_tiles(nope_st.index(cur), sc_st.index(cur), k_stage, 0, 4, BN)
            _dequant_tiles(nope_st.index(cur), sc_st.index(cur), k_stage, 4, 2, BN)
            _dequant_tiles(nope_st.index(cur), sc_st.index(cur), k_stage, 6, 1, BN)
            rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
            k_stage.slice(448, 64, dim=1).store(rope_st.index(cur).load(rope_l))
        fence_async_shared()  # the generic-proxy stores above are read by wgmma (async proxy)
        # Only a plain arrive (after a loader-wide barrier): a cp.async arrive here would also wait
        # for the raw copies of the blocks ahead.
        mbarrier.arrive(full.index(s))


@gluon.jit
def _online_softmax(sc, j, nbw, wlen, elen, idx_s, m_i, l_i, qk_scale_log2, offs_c, p_l: gl.constexpr,
                    BN: gl.constexpr):
    """Mask block j's raw scores, fold them into (m_i, l_i); P in bf16 as the PV wgmma's A operand."""
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
    return gl.convert_layout(p.to(gl.bfloat16), p_l), alpha, m_new, l_new


@gluon.jit
def _compute(b, split, num_splits, lo, hi, nbw, wlen, elen, qk_scale_log2,
             sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
             q_smem, k_smem, idx_all, xbuf, q_bar, full, empty, xfull, xfree,
             HALF: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr,
             SPLIT_OUT: gl.constexpr, HAS_SINK: gl.constexpr, XCH: gl.constexpr, PROBE: gl.constexpr):
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
    s_zero = gl.zeros([H_ALL, BN], gl.float32, layout=s_l)
    offs_c = gl.arange(0, BN, layout=col_s)
    mbarrier.wait(q_bar, 0)
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        mbarrier.wait(full.index(s), (i // NS) & 1)
        fence_async_shared()
        if PROBE != 1:
            k = k_smem.index(s)
            if XCH:
                # S over this warpgroup's 256 dims, swapped with the other warpgroup's half through
                # shared memory: each S element is computed once, and both hold the same full S
                # (fp32 addition commutes, so their softmax statistics agree bit for bit).
                sc = warpgroup_mma(q_smem.slice(HALF * DH, DH, dim=1), k.slice(HALF * DH, DH, dim=1).permute((1, 0)),
                                   s_zero, use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                if i > 0:
                    mbarrier.wait(xfree.index(HALF), (i - 1) & 1)
                xbuf.index(HALF).store(sc)
                mbarrier.arrive(xfull.index(HALF))
                mbarrier.wait(xfull.index(1 - HALF), i & 1)
                sc = sc + xbuf.index(1 - HALF).load(s_l)
                mbarrier.arrive(xfree.index(1 - HALF))
            else:
                sc = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            p_op, alpha, m_i, l_i = _online_softmax(sc, j, nbw, wlen, elen, idx_all.index(j).load(col_s),
                                                    m_i, l_i, qk_scale_log2, offs_c, p_l, BN)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(p_op, k.slice(HALF * DH, DH, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s))

    LN2: gl.constexpr = 0.6931471805599453
    has_any = l_i > 0
    l_safe = gl.where(has_any, l_i, 1.0)
    lse = gl.where(has_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    inv = 1.0 / l_safe
    offs_h = gl.arange(0, H_ALL, layout=row_o)
    offs_d = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_l))
    offs_hs = gl.arange(0, H_ALL, layout=row_s)
    if SPLIT_OUT:
        o = acc * gl.convert_layout(inv, row_o)[:, None]
        row = (b * num_splits + split).to(gl.int64) * H_ALL
        gl.store(part_o_ptr + (row + offs_h[:, None]) * D_ALL + offs_d[None, :], o)
        if HALF == 0:
            gl.store(part_lse_ptr + row + offs_hs, lse)
    else:
        if HAS_SINK:
            sink = gl.load(sink_ptr + offs_hs)
            inv = inv / (1.0 + gl.exp(sink - lse))
        o = acc * gl.convert_layout(inv, row_o)[:, None]
        gl.store(out_ptr + b.to(gl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty))
        if HALF == 0:
            gl.store(lse_ptr + b * stride_lb + offs_hs, lse)


@gluon.jit
def _sparse_decode_ws_kernel(
    q_ptr, stride_qb, stride_qh,
    kv_ptr, stride_kv, ekv_ptr, stride_ekv,
    widx_ptr, stride_wb, W, eidx_ptr, stride_eb, K,
    wlen_ptr, elen_ptr, sink_ptr,
    out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
    part_o_ptr, part_lse_ptr,
    qk_scale_log2, num_splits,
    BN: gl.constexpr, NS: gl.constexpr, SPLIT_OUT: gl.constexpr,
    IS_FP8: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_WLEN: gl.constexpr, HAS_ELEN: gl.constexpr,
    HAS_SINK: gl.constexpr, PAGE_STRIDE: gl.constexpr, SCALES_OFFSET: gl.constexpr,
    LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, XCH: gl.constexpr, NR: gl.constexpr, MAXB: gl.constexpr,
    PROBE: gl.constexpr = 0,
):
    # PROBE (timing experiments only; wrong results): 1 = no math, 2 = no row loads, 3 = fp8: no dequantisation.
    b = gl.program_id(0)
    split = gl.program_id(1)
    lo, hi, nbw, wlen, elen = _block_range(b, split, num_splits, W, K, wlen_ptr, elen_ptr, BN,
                                           HAS_EXTRA, HAS_WLEN, HAS_ELEN)

    nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [H_ALL, D_ALL], nvmma)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, D_ALL], nvmma)
    idx_all = gl.allocate_shared_memory(gl.int32, [MAXB, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if IS_FP8:
        nope_st = gl.allocate_shared_memory(gl.uint8, [NR, BN, 8, 64], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        rope_st = gl.allocate_shared_memory(gl.bfloat16, [NR, BN, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        sc_st = gl.allocate_shared_memory(gl.uint8, [NR, BN, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if XCH:
        xbuf = gl.allocate_shared_memory(gl.float32, [2, H_ALL, BN], gl.SwizzledSharedLayout(2, 1, 8, [1, 0]))
    else:
        xbuf = q_smem  # unused
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    xfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    xfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for h in gl.static_range(2):
        mbarrier.init(xfull.index(h), count=1)
        mbarrier.init(xfree.index(h), count=1)
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=LOADER_WARPS * 32)
    for s in gl.static_range(NS):
        # bf16: one cp.async arrive per loader thread; fp8: one plain arrive after the dequantisation.
        mbarrier.init(full.index(s), count=1 if IS_FP8 else LOADER_WARPS * 32)
        mbarrier.init(empty.index(s), count=2)

    # Registers: the two compute warpgroups share what the loader leaves of the 64K-register file.
    compute_regs: gl.constexpr = (65536 - 32 * LOADER_WARPS * LOADER_REGS) // 256 // 8 * 8
    if IS_FP8:
        gl.warp_specialize([
            (_compute, (b, split, num_splits, lo, hi, nbw, wlen, elen, qk_scale_log2,
                         sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
                         q_smem, k_smem, idx_all, xbuf, q_bar, full, empty, xfull, xfree, 0, BN, NS, SPLIT_OUT, HAS_SINK,
                         XCH, PROBE)),
            (_compute, (b, split, num_splits, lo, hi, nbw, wlen, elen, qk_scale_log2,
                         sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
                         q_smem, k_smem, idx_all, xbuf, q_bar, full, empty, xfull, xfree, 1, BN, NS, SPLIT_OUT, HAS_SINK,
                         XCH, PROBE)),
            (_loader_fp8, (q_ptr, stride_qb, stride_qh, kv_ptr, ekv_ptr, widx_ptr, stride_wb, eidx_ptr, stride_eb,
                           b, lo, hi, nbw, wlen, elen, q_smem, k_smem, idx_all, nope_st, rope_st, sc_st,
                           q_bar, full, empty, BN, NS, NR, MAXB, PAGE_STRIDE, SCALES_OFFSET, PROBE)),
        ], [4, LOADER_WARPS], [compute_regs, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_compute, (b, split, num_splits, lo, hi, nbw, wlen, elen, qk_scale_log2,
                         sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
                         q_smem, k_smem, idx_all, xbuf, q_bar, full, empty, xfull, xfree, 0, BN, NS, SPLIT_OUT, HAS_SINK,
                         XCH, PROBE)),
            (_compute, (b, split, num_splits, lo, hi, nbw, wlen, elen, qk_scale_log2,
                         sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
                         q_smem, k_smem, idx_all, xbuf, q_bar, full, empty, xfull, xfree, 1, BN, NS, SPLIT_OUT, HAS_SINK,
                         XCH, PROBE)),
            (_loader, (q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                       widx_ptr, stride_wb, eidx_ptr, stride_eb, b, lo, hi, nbw, wlen, elen,
                       q_smem, k_smem, idx_all, q_bar, full, empty, BN, NS, MAXB, PAGE_STRIDE, SCALES_OFFSET, PROBE)),
        ], [4, LOADER_WARPS], [compute_regs, LOADER_REGS])
