"""The loader partition of the warp-specialised sparse decode (`gluon_kernel.py`): Q and the index table
first, then per block either bf16 rows gathered straight into the wgmma stages, or V4 fp8 records staged
raw and dequantised into them. Stage handoffs: `full[s]` (loader -> compute), `empty[s]` (compute -> loader).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

H_ALL = gl.constexpr(64)
D_ALL = gl.constexpr(512)


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
def loader_partition(q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                     widx_ptr, stride_wb, eidx_ptr, stride_eb, b, lo, hi, nbw, wlen, elen,
                     q_smem, k_smem, idx_all, nope_st, rope_st, sc_st, q_bar, full, empty,
                     BN: gl.constexpr, NS: gl.constexpr, NR: gl.constexpr, MAXB: gl.constexpr, IS_FP8: gl.constexpr,
                     PAGE_STRIDE: gl.constexpr, SCALES_OFFSET: gl.constexpr, PROBE: gl.constexpr):
    """The loader warps: `_loader_fp8` on V4 fp8 pages (nope_st, rope_st, sc_st: its staging), else `_loader`."""
    if IS_FP8:
        _loader_fp8(q_ptr, stride_qb, stride_qh, kv_ptr, ekv_ptr, widx_ptr, stride_wb, eidx_ptr, stride_eb,
                    b, lo, hi, nbw, wlen, elen, q_smem, k_smem, idx_all, nope_st, rope_st, sc_st,
                    q_bar, full, empty, BN, NS, NR, MAXB, PAGE_STRIDE, SCALES_OFFSET, PROBE)
    else:
        _loader(q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                widx_ptr, stride_wb, eidx_ptr, stride_eb, b, lo, hi, nbw, wlen, elen,
                q_smem, k_smem, idx_all, q_bar, full, empty, BN, NS, MAXB, PAGE_STRIDE, SCALES_OFFSET, PROBE)
