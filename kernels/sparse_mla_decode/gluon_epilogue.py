"""The end of a split of the warp-specialised sparse decode (`gluon_kernel.py`): each compute warpgroup
normalises its half of O and stores it (`_epilogue`): the final output through shared memory
(`_store_rows`), or its split's partial output, which the splits then merge themselves when they are
all resident at once (`_merge_splits`, on the counters of `_SPLIT_BARRIER`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_loaders import D_ALL, H_ALL


@gluon.jit
def lse_and_inverse(m_i, l_i):
    """A split's end of the online softmax (every decode kernel's): its lse (natural log; -inf for a head with no
    valid row) and 1 / l, the factor that normalises O (1 where l is 0)."""
    has_any = l_i > 0
    l_safe = gl.where(has_any, l_i, 1.0)
    LN2: gl.constexpr = 0.6931471805599453
    return gl.where(has_any, (m_i + gl.log2(l_safe)) * LN2, float("-inf")), 1.0 / l_safe


@gluon.jit
def _store_rows(tile, buf, base, stride_row):
    """Store a [64, 256] bf16 tile (wgmma accumulator layout) to rows base + h * stride_row (+ 0 .. 255)
    through shared memory: the tile goes to `buf` (this warpgroup's own, free at the end; stmatrix), then
    each warp stores whole rows, 16 bytes per thread. Stored straight from the accumulator layout, a warp's
    store writes 8 rows 16 bytes apart; at B = 128 (one split) the epilogue then took 4-7 us after the last
    block instead of ~1.3, and the launch 43.7 us instead of 38.1 (H200, in-kernel %globaltimer stamps)."""
    NW: gl.constexpr = gl.num_warps()
    DH: gl.constexpr = D_ALL // 2
    EPT: gl.constexpr = 128 // tile.dtype.primitive_bitwidth  # elements per 16-byte store
    RC: gl.constexpr = 16  # rows per pass (32 registers a thread)
    buf.store(tile)
    gl.barrier()
    l: gl.constexpr = gl.BlockedLayout([1, EPT], [1, 32], [NW, 1], [1, 0])
    offs_d = gl.arange(0, DH, layout=gl.SliceLayout(0, l))
    for r in gl.static_range(H_ALL // RC):
        offs_h = r * RC + gl.arange(0, RC, layout=gl.SliceLayout(1, l))
        part = buf.slice(r * RC, RC, dim=0).load(l)
        gl.store(base + offs_h.to(gl.int64)[:, None] * stride_row + offs_d[None, :], part)


@gluon.jit
def _epilogue(acc, m_i, l_i, sink, b, split, num_splits, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr,
              stride_lb, part_o_ptr, part_lse_ptr, counter_ptr, buf, o_l: gl.constexpr,
              row_s: gl.constexpr, HALF: gl.constexpr, SPLIT_OUT: gl.constexpr, HAS_SINK: gl.constexpr,
              FUSE_MERGE: gl.constexpr, SP: gl.constexpr, MHT: gl.constexpr, MDC: gl.constexpr):
    """Normalise this warpgroup's half of O by the softmax sum and store it (lse from the HALF 0 warpgroup):
    the final output through `buf` (`_store_rows`), split partials straight. sink: the query's per-head
    sinks in row_s, loaded before the loop (unsplit output with HAS_SINK only). For the fused merge, a head
    with no valid row stores only its lse (-inf: `_merge_splits` skips its partial output), and then the
    warpgroup takes its part in `_merge_splits`."""
    DH: gl.constexpr = D_ALL // 2
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    lse, inv = lse_and_inverse(m_i, l_i)
    offs_hs = gl.arange(0, H_ALL, layout=row_s)
    if SPLIT_OUT:
        # fp32 partials straight from the accumulator layout (a warp's store fills whole 32-byte sectors):
        # through shared memory as below, B = 8 / 32 / 64 measured 0.3-0.5 us slower in bf16 (H200)
        o = acc * gl.convert_layout(inv, row_o)[:, None]
        row = (b * num_splits + split).to(gl.int64) * H_ALL
        offs_h = gl.arange(0, H_ALL, layout=row_o)
        offs_d = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_l))
        if FUSE_MERGE:
            gl.store(part_o_ptr + (row + offs_h[:, None]) * D_ALL + offs_d[None, :], o,
                     mask=gl.convert_layout(l_i > 0, row_o)[:, None])
        else:
            gl.store(part_o_ptr + (row + offs_h[:, None]) * D_ALL + offs_d[None, :], o)
        if HALF == 0:
            gl.store(part_lse_ptr + row + offs_hs, lse)
        if FUSE_MERGE:
            _merge_splits(b, split, num_splits, counter_ptr, part_o_ptr, part_lse_ptr, sink_ptr, out_ptr, stride_ob,
                          stride_oh, lse_ptr, stride_lb, HALF, SP, MHT, MDC, HAS_SINK)
    else:
        if HAS_SINK:
            inv = inv / (1.0 + gl.exp(sink - lse))
        o = acc * gl.convert_layout(inv, row_o)[:, None]
        _store_rows(o.to(out_ptr.dtype.element_ty), buf, out_ptr + b.to(gl.int64) * stride_ob + HALF * DH,
                    stride_oh)
        if HALF == 0:
            gl.store(lse_ptr + b * stride_lb + offs_hs, lse)


# One warp of a compute warpgroup, once its share of the split's partial output is stored: arrive on query
# b's split barrier ($1: two u32 counters, arrivals then departures, alone in their 128-byte line), wait
# until all $2 = 8 x num_splits compute warps of the query have arrived (polling every ~SPIN_NS ns: warps that
# spin flat out on one line slow every other access to its L2 slice), then count out; the last warp out
# zeroes both counters for the next launch. bar.warp.sync orders the lanes' stores before lane 0's release
# (GPU scope); every lane acquires, so each sees every split's partial output. $0: the arrivals seen.
# The wait is bounded: all splits are resident (cooperative launch), so a legitimate wait lasts as long as
# the slowest split, microseconds. Counters that cannot reach the count (two launches sharing them at
# once, a buffer that was not zeroed) would otherwise spin forever; after SPIN_LIMIT_NS of %globaltimer
# the warp executes `trap`, so the launch fails with a CUDA error (the process's CUDA context is lost)
# instead of hanging the stream, the process and every request behind it. The check stays predicated in the
# loop: written out of line (`@q bra DONE`, sleep and check after it) it cost 5 us at B = 8 (H200).
COUNTER_STRIDE = gl.constexpr(32)  # int32s between two queries' counters (launch.COUNTER_STRIDE)
SPIN_NS = 100
SPIN_LIMIT_NS = 2_000_000_000
_SPLIT_BARRIER = gl.constexpr("""{
.reg .pred p, q, r;
.reg .u32 old, last, zero;
.reg .u64 t0, t1;
mov.u32 old, %laneid;
setp.eq.u32 p, old, 0;
bar.warp.sync -1;
@p red.release.gpu.global.add.u32 [$1], 1;
mov.u64 t0, %globaltimer;
SPLIT_WAIT_${:uid}:
ld.acquire.gpu.global.u32 $0, [$1];
setp.lt.u32 q, $0, $2;
@q nanosleep.u32 SPIN_NS;
mov.u64 t1, %globaltimer;
sub.u64 t1, t1, t0;
setp.gt.and.u64 r, t1, SPIN_LIMIT_NS, q;
@r trap;
@q bra SPLIT_WAIT_${:uid};
mov.u32 old, 0;
@p atom.relaxed.gpu.global.add.u32 old, [$1+4], 1;
sub.u32 last, $2, 1;
setp.eq.and.u32 q, old, last, p;
mov.u32 zero, 0;
@q st.relaxed.gpu.global.v2.u32 [$1], {zero, zero};
}""".replace("SPIN_LIMIT_NS", str(SPIN_LIMIT_NS)).replace("SPIN_NS", str(SPIN_NS)))


def fused_merge_tile(splits: int) -> tuple[int, int, int]:
    """(SP, MHT, MDC) of `_merge_splits` for `splits` splits: splits and heads per split rounded up to powers
    of two, and the dims merged at a time, as many as keep the [SP, MHT, MDC] fp32 tile at 64 registers per
    thread (<= 128: 32 lanes x 4 dims; MDC 128 at 10 splits spilled 136-252 B in warpgroup 1)."""
    sp = 1 << (splits - 1).bit_length()
    mht = 1 << (-(-64 // splits) - 1).bit_length()
    return sp, mht, max(16, min(128, 64 * 128 // (sp * mht)))


@gluon.jit
def _merge_splits(b, split, num_splits, counter_ptr, part_o_ptr, part_lse_ptr, sink_ptr, out_ptr, stride_ob,
                  stride_oh, lse_ptr, stride_lb, HALF: gl.constexpr, SP: gl.constexpr, MHT: gl.constexpr,
                  MDC: gl.constexpr, HAS_SINK: gl.constexpr):
    """The fused split merge, run by both compute warpgroups of every split once their partial outputs are
    stored. The launch is cooperative (every split of every query is resident), so waiting on the query's
    other splits cannot deadlock. Then this split merges heads [split * hp, + hp), hp = ceil(64 / splits),
    over this warpgroup's half of the dims, MDC dims at a time with all splits' tiles loaded at once
    ([SP, MHT, MDC]; SP >= splits, MHT >= hp, powers of two), from L2 (.cg: the partials were written by
    other SMs during this launch)."""
    NW: gl.constexpr = gl.num_warps()
    DH: gl.constexpr = D_ALL // 2
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    lanes = gl.arange(0, 32 * NW, layout=one_l)
    gl.inline_asm_elementwise(_SPLIT_BARRIER, "=r,l,r",
                              [counter_ptr + COUNTER_STRIDE * b + lanes * 0,
                               gl.full([32 * NW], 8, gl.int32, one_l) * num_splits],
                              dtype=gl.int32, is_pure=False, pack=1)

    l3: gl.constexpr = gl.BlockedLayout([SP, 1, 4], [1, 32 // (MDC // 4), MDC // 4], [1, NW, 1], [2, 1, 0])
    l_sh: gl.constexpr = gl.SliceLayout(2, l3)  # [SP, MHT]
    l_hd: gl.constexpr = gl.SliceLayout(0, l3)  # [MHT, MDC]
    hp = (H_ALL + num_splits - 1) // num_splits
    h0 = split * hp
    offs_s = gl.arange(0, SP, layout=gl.SliceLayout(1, l_sh))
    offs_h = h0 + gl.arange(0, MHT, layout=gl.SliceLayout(0, l_sh))
    h_ok = (offs_h < h0 + hp) & (offs_h < H_ALL)
    ok = (offs_s < num_splits)[:, None] & h_ok[None, :]
    rows = (b * num_splits + offs_s).to(gl.int64)[:, None] * H_ALL + offs_h[None, :]
    lse_s = gl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
    lse_max = gl.max(lse_s, axis=0)
    max_safe = gl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = gl.exp(lse_s - max_safe[None, :])
    w_sum = gl.sum(w, axis=0)
    has_any = w_sum > 0
    w_safe = gl.where(has_any, w_sum, 1.0)
    lse = gl.where(has_any, max_safe + gl.log(w_safe), float("-inf"))
    inv = 1.0 / w_safe
    if HAS_SINK:
        inv = inv / (1.0 + gl.exp(gl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) - lse))
    w = w * inv[None, :]
    if HALF == 0:
        gl.store(lse_ptr + b * stride_lb + offs_h, lse, mask=h_ok)

    offs_d = gl.arange(0, MDC, layout=gl.SliceLayout(0, l_hd))  # dims of the merged [MHT, MDC] tile
    offs_d3 = gl.arange(0, MDC, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))  # of the [SP, MHT, MDC] tile
    oh = h0 + gl.arange(0, MHT, layout=gl.SliceLayout(1, l_hd))
    o_rows = out_ptr + b.to(gl.int64) * stride_ob + oh[:, None] * stride_oh
    o_ok = ((oh < h0 + hp) & (oh < H_ALL))[:, None]
    p_rows = part_o_ptr + rows[:, :, None] * D_ALL
    live = (ok & (lse_s > float("-inf")))[:, :, None]  # a (split, head) with no row stored no output
    for c in gl.static_range(DH // MDC):
        d0 = HALF * DH + c * MDC
        parts = gl.load(p_rows + (d0 + offs_d3)[None, None, :], mask=live, other=0.0, cache_modifier=".cg")
        o = gl.sum(w[:, :, None] * parts, axis=0)
        gl.store(o_rows + (d0 + offs_d)[None, :], o.to(out_ptr.dtype.element_ty), mask=o_ok)


@gluon.jit
def _out_buf(smem, TILES: gl.constexpr):
    """A [64, 256] bf16 view of the start of `smem`, for `_store_rows`. `smem` holds exactly TILES such tiles:
    a reinterpretation keeps the buffer's whole size (Triton 3.8 refuses a smaller view), then the first."""
    DH: gl.constexpr = D_ALL // 2
    return smem._reinterpret(gl.bfloat16, [TILES, H_ALL, DH],
                             gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)).index(0)


@gluon.jit
def _early_sink(sink_ptr, row_s: gl.constexpr, SPLIT_OUT: gl.constexpr, HAS_SINK: gl.constexpr):
    """The per-head sinks, loaded before the block loop so that the epilogue does not wait on them (unsplit
    output with sinks; otherwise the merge applies them, and this is zeros)."""
    offs = gl.arange(0, H_ALL, layout=row_s)
    if HAS_SINK and not SPLIT_OUT:
        return gl.load(sink_ptr + offs)
    return gl.zeros([H_ALL], gl.float32, layout=row_s)
