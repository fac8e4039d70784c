"""The loader partition of the warp-specialised sparse decode (`gluon_kernel.py`): Q and the index table
first, then per block either bf16 rows gathered straight into the wgmma stages, or V4 fp8 records loaded
into registers and dequantised into them. Stage handoffs: `full[s]` (loader -> compute), `empty[s]`
(compute -> loader).
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
    """cp.async the index table into idx_all [MAXB, BN]: the nbw window blocks (of wlen indices), then the
    extra blocks (of elen), zeros past the lengths within the last block (readers mask by position). Called
    with the query's lengths (row j = live block j) or with W and K (`_table_row`). Only the rows those
    lengths reach are copied, R at a time: at a configured 1M context the ratio-128 table has 256 rows and a
    query of 2,048 tokens reaches 3 of them, and zero-filling the rest cost every CTA its issue slots. One round
    trip for all of it, so no block waits on an index load before its rows can be gathered."""
    NW: gl.constexpr = gl.num_warps()
    TPR: gl.constexpr = 32 // (BN // 4)
    R: gl.constexpr = TPR * NW if TPR * NW < MAXB else MAXB  # rows one pass of the layout covers
    l: gl.constexpr = gl.BlockedLayout([1, 4], [TPR, BN // 4], [NW, 1], [1, 0])
    rr = gl.arange(0, R, layout=gl.SliceLayout(1, l))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, l))
    # idx_all is allocated with a rank-1 layout (so that .index(j) gives block j); the copies need the same
    # unswizzled row-major bytes seen as [MAXB / R, R, BN], so that .index(i) gives rows i*R .. i*R + R - 1.
    chunks = idx_all._reinterpret(gl.int32, [MAXB // R, R, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    nrows = gl.minimum(nbw + (elen + BN - 1) // BN, MAXB)
    for i in range(0, (nrows + R - 1) // R):
        jr = i * R + rr
        is_w = jr < nbw
        blk = gl.where(is_w, jr, jr - nbw)
        n_valid = gl.where(is_w, wlen, elen)
        pos = blk[:, None] * BN + c[None, :]
        ptrs = gl.where(is_w[:, None], widx_row + pos, eidx_row + pos)
        async_copy.async_copy_global_to_shared(chunks.index(i), ptrs, mask=(pos >= 0) & (pos < n_valid[:, None]))


@gluon.jit
def _table_row(j, nbw, nbw_t):
    """Row of the index table that holds live block j when the table has nbw_t window blocks (nbw_t = nbw:
    the table was staged by the query's lengths, and the row is j; nbw_t = ceil(W / BN): staged by W and K
    before the lengths were known)."""
    return gl.where(j < nbw, j, j - nbw + nbw_t)


@gluon.jit
def _round_rows(idx_all, j, hi, nbw, nbw_t, wlen, elen, r0: gl.constexpr, R: gl.constexpr, row_l: gl.constexpr,
                MAXB: gl.constexpr, BN: gl.constexpr):
    """Cache rows r0 .. r0 + R - 1 of live block j from the staged table, in layout row_l (-1 where invalid or
    past the length; all -1 for j >= hi)."""
    offs = r0 + gl.arange(0, R, layout=row_l)
    is_w = j < nbw
    blk = gl.where(is_w, j, j - nbw)
    n_valid = gl.where(j < hi, gl.where(is_w, wlen, elen), 0)
    idx = idx_all.index(gl.minimum(_table_row(j, nbw, nbw_t), MAXB - 1)).slice(r0, R).load(row_l)
    return gl.where(blk * BN + offs < n_valid, idx, -1)


@gluon.jit
def stage_q_and_indices(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen, elen,
                        q_smem, idx_all, t_bar, q_bar, MAXB: gl.constexpr, BN: gl.constexpr):
    """The index table (`_stage_indices`), then Q (64 heads x 512 dims), by cp.async; t_bar completes when
    the table has landed, q_bar when Q has too (one arrival per calling thread on each). The loader waits
    for the table only, so the first rows' loads go out while Q (64 KB) is still arriving; the compute
    warpgroups wait for Q. The loader runs this itself, or (EARLY_TABLE) the kernel body does, before the
    per-query lengths are loaded."""
    NW: gl.constexpr = gl.num_warps()
    widx_row = widx_ptr + b.to(gl.int64) * stride_wb
    eidx_row = eidx_ptr + b.to(gl.int64) * stride_eb
    _stage_indices(idx_all, widx_row, eidx_row, nbw, wlen, elen, MAXB, BN)
    async_copy.mbarrier_arrive(t_bar, increment_count=False)  # tracks this thread's cp.asyncs so far
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    qh = gl.arange(0, q_smem.shape[0], layout=gl.SliceLayout(1, rows_l))  # 64 heads, or 16 (gluon_h16.py)
    qd = gl.arange(0, D_ALL, layout=gl.SliceLayout(0, rows_l))
    q_ptrs = q_ptr + b.to(gl.int64) * stride_qb + qh[:, None] * stride_qh + qd[None, :]
    async_copy.async_copy_global_to_shared(q_smem, q_ptrs)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)


@gluon.jit
def _table_ready(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen, elen,
                 q_smem, idx_all, t_bar, q_bar, MAXB: gl.constexpr, BN: gl.constexpr, EARLY_TABLE: gl.constexpr):
    """A loader's start: stage Q and the index table (unless the early-table path already did), then wait
    until the table has landed, since the loader reads it next (Q is the compute warpgroups' to wait for)."""
    if not EARLY_TABLE:
        stage_q_and_indices(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen,
                            elen, q_smem, idx_all, t_bar, q_bar, MAXB, BN)
    mbarrier.wait(t_bar, 0)


@gluon.jit
def _loader(q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
            widx_ptr, stride_wb, eidx_ptr, stride_eb,
            b, lo, hi, nbw, nbw_t, wlen, elen,
            q_smem, k_smem, idx_all, t_bar, q_bar, full, empty,
            BN: gl.constexpr, NS: gl.constexpr, MAXB: gl.constexpr,
            W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr,
            EARLY_TABLE: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    _table_ready(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen, elen,
                 q_smem, idx_all, t_bar, q_bar, MAXB, BN, EARLY_TABLE)

    offs_d = gl.arange(0, D_ALL, layout=gl.SliceLayout(0, rows_l))
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        idx = _round_rows(idx_all, j, hi, nbw, nbw_t, wlen, elen, 0, BN, gl.SliceLayout(1, rows_l), MAXB, BN)
        if i >= NS:  # wait until both compute warpgroups are done with this stage's previous block
            mbarrier.wait(empty.index(s), ((i // NS) + 1) & 1)
        valid = idx >= 0
        base = gl.where(j < nbw, kv_ptr, ekv_ptr)
        stride = gl.where(j < nbw, stride_kv, stride_ekv)
        ptrs = base + idx.to(gl.int64)[:, None] * stride + offs_d[None, :]
        async_copy.async_copy_global_to_shared(k_smem.index(s), ptrs, mask=valid[:, None])
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _page_slot(idx, j, nbw, kv_ptr, ekv_ptr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr,
               E_PAGE: gl.constexpr):
    """V4 cache rows idx of live block j (its window or extra cache, pages of 2**shift tokens, page bytes
    apart) -> (page base pointer, slot in the page, the page's scales base); an invalid row (-1) reads as
    row 0, which the callers mask."""
    safe = gl.maximum(idx, 0)
    is_w = (j < nbw).to(gl.int32)
    shift = E_SHIFT + is_w * (W_SHIFT - E_SHIFT)
    page_bytes = E_PAGE + is_w.to(gl.int64) * (W_PAGE - E_PAGE)
    page = gl.where(j < nbw, kv_ptr, ekv_ptr) + (safe >> shift).to(gl.int64) * page_bytes
    return page, safe & ((1 << shift) - 1), page + (576 << shift)


@gluon.jit
def _load_nope(idx_all, j, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, r0: gl.constexpr, R: gl.constexpr,
               T0: gl.constexpr, G: gl.constexpr, MAXB: gl.constexpr, BN: gl.constexpr,
               W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr):
    """e4m3 tiles T0 .. T0 + G - 1 (64 dims each) of rows r0 .. r0 + R - 1 of live block j, as int32
    words of 4 e4m3 bytes (16 bytes per thread and load; zeros for invalid rows), and each (row, tile)'s
    scale 2**(ue8m0 - 127) as a bf16x2 word."""
    NW: gl.constexpr = gl.num_warps()
    deq_l: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8 // G, G, 4], [NW, 1, 1], [2, 1, 0])
    sc_l: gl.constexpr = gl.SliceLayout(2, deq_l)
    row_l: gl.constexpr = gl.SliceLayout(1, sc_l)
    idx = _round_rows(idx_all, j, hi, nbw, nbw_t, wlen, elen, r0, R, row_l, MAXB, BN)
    valid = idx >= 0
    page, slot, scales = _page_slot(idx, j, nbw, kv_ptr, ekv_ptr, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    t = T0 + gl.arange(0, G, layout=gl.SliceLayout(0, sc_l))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, deq_l)))
    rec = (page + slot * 576).to(gl.pointer_type(gl.int32), bitcast=True)
    raw = gl.load(rec[:, None, None] + (t[None, :, None] * 16 + c[None, None, :]), mask=valid[:, None, None],
                  other=0)
    e = gl.load((scales + slot * 8)[:, None] + t[None, :], mask=valid[:, None], other=127).to(gl.int32)
    bits = gl.where(e == 0, 0x40, e << 7)  # bf16 2**(e - 127); e = 0 is the subnormal 2**-127
    return raw, bits | (bits << 16)


@gluon.jit
def _load_rope(idx_all, j, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, r0: gl.constexpr, R: gl.constexpr,
               MAXB: gl.constexpr, BN: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr,
               E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr):
    """The 64 bf16 RoPE dims of rows r0 .. r0 + R - 1 of live block j, as 32 int32 words per row (zeros
    for invalid rows)."""
    NW: gl.constexpr = gl.num_warps()
    rope_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    idx = _round_rows(idx_all, j, hi, nbw, nbw_t, wlen, elen, r0, R, gl.SliceLayout(1, rope_l), MAXB, BN)
    page, slot, scales = _page_slot(idx, j, nbw, kv_ptr, ekv_ptr, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    rec = page + slot * 576
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, rope_l))
    ptrs = (rec + 448).to(gl.pointer_type(gl.int32), bitcast=True)[:, None] + c[None, :]
    return gl.load(ptrs, mask=(idx >= 0)[:, None], other=0)


@gluon.jit
def _load_round(idx_all, j, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, r0: gl.constexpr, R: gl.constexpr,
                MAXB: gl.constexpr, BN: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr,
                E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr):
    """One round (rows r0 .. r0 + R - 1 of live block j) into registers: e4m3 tiles 0-3, 4-5 and 6 with
    their scales (three groups, so no element pays a select), and the RoPE words."""
    n4, s4 = _load_nope(idx_all, j, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, r0, R, 0, 4, MAXB, BN, W_SHIFT,
                        W_PAGE, E_SHIFT, E_PAGE)
    n2, s2 = _load_nope(idx_all, j, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, r0, R, 4, 2, MAXB, BN, W_SHIFT,
                        W_PAGE, E_SHIFT, E_PAGE)
    n1, s1 = _load_nope(idx_all, j, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, r0, R, 6, 1, MAXB, BN, W_SHIFT,
                        W_PAGE, E_SHIFT, E_PAGE)
    rp = _load_rope(idx_all, j, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, r0, R, MAXB, BN, W_SHIFT, W_PAGE, E_SHIFT,
                    E_PAGE)
    return n4, s4, n2, s2, n1, s1, rp


# 4 e4m3 bytes -> 2 bf16x2 words, times a bf16x2 scale. bf16 bits (sign << 15) | ((byte & 0x7f) << 4)
# are the e4m3 value times 2**-120 exactly (e4m3 subnormals become bf16 subnormals), so two
# multiplications by powers of two, 2**120 and the scale, give the exact dequantised value. Integer
# and half-precision ops only: the hardware e4m3 conversions (fp8 -> f16 -> f32 -> bf16) issue at a
# quarter of that rate and were the fp8 loader's bottleneck.
_E4M3_TO_BF16X2 = gl.constexpr("""{
.reg .b32 m, s, t, u, k;
and.b32 m, $2, 0x7f7f7f7f;
and.b32 s, $2, 0x80808080;
mov.b32 k, 0x7b807b80;
prmt.b32 t, m, 0, 0x4140;
prmt.b32 u, s, 0, 0x1404;
mad.lo.u32 t, t, 16, u;
mul.rn.bf16x2 t, t, k;
mul.rn.bf16x2 $0, t, $3;
prmt.b32 t, m, 0, 0x4342;
prmt.b32 u, s, 0, 0x3424;
mad.lo.u32 t, t, 16, u;
mul.rn.bf16x2 t, t, k;
mul.rn.bf16x2 $1, t, $3;
}""")


@gluon.jit
def _store_dequant(k_words, raw, scw, r0: gl.constexpr, R: gl.constexpr, T0: gl.constexpr, G: gl.constexpr):
    """k_words (the stage as int32 [BN, 256]) rows r0 .. r0 + R - 1, dims 64*T0 .. 64*(T0+G) - 1 =
    the e4m3 words `raw` dequantised with their scales `scw`, in bf16."""
    lo, hi = gl.inline_asm_elementwise(_E4M3_TO_BF16X2, "=r,=r,r,r", [raw, scw[:, :, None]],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    words = gl.reshape(gl.join(lo, hi), [R, G * 32])
    k_words.slice(r0, R, dim=0).slice(T0 * 32, G * 32, dim=1).store(words)


@gluon.jit
def _loader_fp8(q_ptr, stride_qb, stride_qh, kv_ptr, ekv_ptr,
                       widx_ptr, stride_wb, eidx_ptr, stride_eb,
                       b, lo, hi, nbw, nbw_t, wlen, elen,
                       q_smem, k_smem, idx_all, t_bar, q_bar, full, empty,
                       BN: gl.constexpr, NS: gl.constexpr, MAXB: gl.constexpr,
                       W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr,
                       EARLY_TABLE: gl.constexpr):
    """V4 fp8 pages: the records of a block are loaded into registers (the next round's loads in flight
    while this one is dequantised) and stored, dequantised, into the bf16 stage the wgmmas read. Rounds
    of R = 32 rows; a block is BN // R rounds. (Staging the raw records in shared memory by cp.async
    first was slower at every B >= 8 once both ran the same dequantisation: bench/results.)"""
    R: gl.constexpr = 32
    RPB: gl.constexpr = BN // R
    # The bf16 stage seen as int32 words: the same bytes and 128-byte swizzle (32 words = 64 dims per line).
    words_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    _table_ready(q_ptr, stride_qb, stride_qh, widx_ptr, stride_wb, eidx_ptr, stride_eb, b, nbw, wlen, elen,
                 q_smem, idx_all, t_bar, q_bar, MAXB, BN, EARLY_TABLE)
    n4, s4, n2, s2, n1, s1, rp = _load_round(idx_all, lo, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr, 0, R, MAXB, BN,
                                             W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        k_words = k_smem.index(s)._reinterpret(gl.int32, [BN, D_ALL // 2], words_l)
        for r in gl.static_range(RPB):
            c4 = n4
            d4 = s4
            c2 = n2
            d2 = s2
            c1 = n1
            d1 = s1
            cr = rp
            # the next round's loads go out before this round is dequantised
            jn = j if r + 1 < RPB else j + 1
            n4, s4, n2, s2, n1, s1, rp = _load_round(idx_all, jn, hi, nbw, nbw_t, wlen, elen, kv_ptr, ekv_ptr,
                                                     ((r + 1) % RPB) * R, R, MAXB, BN, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
            if r == 0:
                if i >= NS:  # both compute warpgroups are done with this stage's previous block
                    mbarrier.wait(empty.index(s), ((i // NS) + 1) & 1)
            # e4m3 tiles 0-3, 4-5 and 6 (448 dims) in three groups, so no element pays a select;
            # the RoPE dims are bf16 already and are stored as they are.
            _store_dequant(k_words, c4, d4, r * R, R, 0, 4)
            _store_dequant(k_words, c2, d2, r * R, R, 4, 2)
            _store_dequant(k_words, c1, d1, r * R, R, 6, 1)
            k_words.slice(r * R, R, dim=0).slice(224, 32, dim=1).store(cr)
        fence_async_shared()  # the generic-proxy stores above are read by wgmma (async proxy)
        gl.barrier()  # every loader thread's stores are in before the one arrive
        mbarrier.arrive(full.index(s))


@gluon.jit
def loader_partition(q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                     widx_ptr, stride_wb, eidx_ptr, stride_eb, b, lo, hi, nbw, nbw_t, wlen, elen,
                     q_smem, k_smem, idx_all, t_bar, q_bar, full, empty,
                     BN: gl.constexpr, NS: gl.constexpr, MAXB: gl.constexpr, IS_FP8: gl.constexpr,
                     W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr,
                     EARLY_TABLE: gl.constexpr):
    """The loader warps: `_loader_fp8` on V4 fp8 pages, else `_loader` (bf16 rows)."""
    if IS_FP8:
        _loader_fp8(q_ptr, stride_qb, stride_qh, kv_ptr, ekv_ptr, widx_ptr, stride_wb, eidx_ptr, stride_eb,
                    b, lo, hi, nbw, nbw_t, wlen, elen, q_smem, k_smem, idx_all, t_bar, q_bar, full, empty,
                    BN, NS, MAXB, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE, EARLY_TABLE)
    else:
        _loader(q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                widx_ptr, stride_wb, eidx_ptr, stride_eb, b, lo, hi, nbw, nbw_t, wlen, elen,
                q_smem, k_smem, idx_all, t_bar, q_bar, full, empty, BN, NS, MAXB, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE,
                EARLY_TABLE)
