"""Sparse MLA decode for GPUs with mma.sync and 99 KB of shared memory a block (sm_120: RTX PRO 6000 Blackwell), in
Gluon, so that each selected row is gathered and dequantised once for all 64 heads of its query.

Why not the Triton kernel there: Triton keeps a dot's operands and a [64, 512] fp32 accumulator in registers, which
spill on mma.sync, so the Triton row runs 16-head programs that each gather and dequantise the same rows: four times
the L1 traffic (ncu, B = 128: L1/TEX 67% busy, DRAM 2%; bench/results/ncu_sm120_c4_b128.txt).

One CTA of 8 warps per (query, split); every mma.sync tile is laid out over warps [4, 2] (16 heads a warp along M,
the columns of S and of O over two warps). `LaunchConfig(num_warps=16)` lays them out [4, 4]: O's columns over four
warps, S's 16 columns held twice; 128 registers and 116 B spilled for sm_120a, not measured yet (bench/sm120_decode.py
`SM120_SECTIONS=backends` times it):

    Q        [64, 512] bf16, staged once in shared memory (64 KB); its 16-dim slices are read per k-step (ldmatrix).
    rows     two [16, 512] bf16 stages (32 KB). Block j's products read stage j % 2 while block j + 1, loaded into
             registers an iteration earlier, is dequantised beside them (ALU work next to the mma.sync) and stored
             to the other stage, which block j - 1 last read before the barrier that ended it. Block j + 2's rows
             and block j + 3's indices are loaded meanwhile: a warp issues in order, so a load is waited for only
             an iteration after it went out.
    S        Q K^T as four independent chains of mma.sync (128 dims each, not one chain of 32), the online softmax
             in fp32; the row sums are kept per element and reduced once at the end.
    O        [64, 512] fp32 in registers as four 128-column accumulators, O_c = O_c * alpha + P K[:, c]; P is
             converted once a block to the A-operand layout.

Options (LaunchConfig fields; the dispatch table's sm_120 rows turn on the first two): `fp8_words=True` dequantises
four e4m3 bytes at a time in 32-bit words (`E4M3_WORD`; 690 loop instructions a warp against 781), `lazy_rescale=True`
moves the reference max only when a block's max passes it by more than 2**8 (decided for the whole CTA, so a block
that moves no max skips O's rescale: 145 of the 727 loop instructions a warp, sm_120a), and 16 warps. Measured on an
H100 standing in (bench/results/sm120_backends.md, c4, B = 128): 115.8 us neither, 100.1 words, 108.7 lazy, 99.9
both, 146.9 both at 16 warps. Neither option on, the kernel compiles to the same sm_120a instructions as before they
existed. 16 heads (TP4's real count): one warp row, 4 or 8 warps across S's and O's columns (49,664 B).

Shared memory 100,352 B with the layout conversions' scratch (sm_120 allows 101,376); 255 registers, no spill as
compiled for sm_120a (tests/kernels/test_dispatch.py). Output: (out, lse), or split partials [B, splits, 64, 512] in
the layout `kernel._combine_kernel` / `_combine_stream_kernel` merge. Semantics are those of `reference.py`; live
block j < nbw is window block j, else extra block j - nbw, as in `kernel.py`. Measured (H100 standing in,
bench/results/sm120_backends.md): 1.4-2.2x the Triton row from B = 8; slower at B = 1, where the dispatch table keeps
the Triton row (`DecodeImpl.min_batch`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .gluon_epilogue import lse_and_inverse
from .gluon_kernel import _block_range

D_ALL = gl.constexpr(512)
LAZY_LOG2 = gl.constexpr(8.0)  # LaunchConfig(lazy_rescale=True): how far p may grow past 1, in log2


@gluon.jit
def _block_indices(j, hi, nbw, wlen, elen, widx_row, eidx_row, offs, BN: gl.constexpr):
    """Cache rows of live block j at positions `offs` (its layout), -1 where invalid, past the length or j >= hi."""
    is_w = j < nbw
    pos = gl.where(is_w, j, j - nbw) * BN + offs
    n_valid = gl.where(j < hi, gl.where(is_w, wlen, elen), 0)
    return gl.load(gl.where(is_w, widx_row, eidx_row) + pos, mask=pos < n_valid, other=-1)


@gluon.jit
def _load_raw(j, nbw, idx, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3: gl.constexpr, IS_FP8: gl.constexpr,
              WORDS: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr,
              E_PAGE: gl.constexpr):
    """Block j's bytes for its rows `idx` (`_block_indices` in L3's row layout), as loaded (registers, layout L3
    over [BN, 8, 64]): fp8 -> (no-RoPE e4m3 bytes of tiles 0-6, RoPE bf16 in tile 7, the tiles' ue8m0 scales
    [BN, 8]); bf16 rows -> the row values (dims t * 64 + c of tile t) in the first two, an unused third. WORDS (fp8
    only): `_load_words`."""
    t = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    is_w = j < nbw
    valid = idx >= 0
    v3 = valid[:, None, None]
    t3 = t[None, :, None]
    c3 = c[None, None, :]
    base = gl.where(is_w, kv_ptr, ekv_ptr)
    if IS_FP8 and WORDS:
        nope, rope, sc = _load_words(is_w, idx, base, L3, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    elif IS_FP8:
        shift = gl.where(is_w, W_SHIFT, E_SHIFT)
        page_bytes = gl.where(is_w, W_PAGE, E_PAGE)
        page = idx >> shift
        slot = idx & ((1 << shift) - 1)
        page_base = base + page.to(gl.int64) * page_bytes
        rec = (page_base + slot * 576)[:, None, None]
        nope = gl.load(rec + (t3 * 64 + c3), mask=v3 & (t3 < 7), other=0)
        # the RoPE dims as bf16 elements of the cache (a byte pointer cast to bf16 loses its alignment, and the
        # loads would go out 2 bytes at a time)
        rope_row = page.to(gl.int64) * gl.where(is_w, W_PAGE // 2, E_PAGE // 2) + slot * 288 + 224
        rope = gl.load(base.to(gl.pointer_type(gl.bfloat16), bitcast=True) + rope_row[:, None, None] + (c3 + t3 * 0),
                       mask=v3 & (t3 == 7), other=0.0)
        sc_ptr = (page_base + (576 << shift) + slot * 8)[:, None] + t[None, :]
        sc = gl.load(sc_ptr, mask=valid[:, None] & (t < 7)[None, :], other=127)
    else:
        stride = gl.where(is_w, stride_kv, stride_ekv)
        nope = gl.load(base + idx.to(gl.int64)[:, None, None] * stride + (t3 * 64 + c3), mask=v3, other=0.0)
        rope, sc = nope, t
    return nope, rope, sc


@gluon.jit
def _load_words(is_w, idx, base, L3: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr,
                E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr):
    """`_load_raw` of V4 fp8 rows in 32-bit words (L3 over [BN, 8, 16]): the no-RoPE tiles as int32 words of four
    e4m3 bytes, the RoPE tile as int64 words of four bf16 (word w: dims 4w .. 4w + 3 of the tile), the scales."""
    t = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    w = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    valid = idx >= 0
    v3 = valid[:, None, None]
    t3 = t[None, :, None]
    w3 = w[None, None, :]
    shift = gl.where(is_w, W_SHIFT, E_SHIFT)
    page = (idx >> shift).to(gl.int64)
    slot = idx & ((1 << shift) - 1)
    row32 = page * gl.where(is_w, W_PAGE // 4, E_PAGE // 4) + slot * 144  # a 576-B record is 144 int32 words
    nope = gl.load(base.to(gl.pointer_type(gl.int32), bitcast=True) + row32[:, None, None] + (t3 * 16 + w3),
                   mask=v3 & (t3 < 7), other=0)
    row64 = page * gl.where(is_w, W_PAGE // 8, E_PAGE // 8) + slot * 72 + 56  # the RoPE dims start at byte 448
    rope = gl.load(base.to(gl.pointer_type(gl.int64), bitcast=True) + row64[:, None, None] + (w3 + t3 * 0),
                   mask=v3 & (t3 == 7), other=0)
    sc_ptr = (base + page * gl.where(is_w, W_PAGE, E_PAGE) + (576 << shift) + slot * 8)[:, None] + t[None, :]
    sc = gl.load(sc_ptr, mask=valid[:, None] & (t < 7)[None, :], other=127)
    return nope, rope, sc


# WORDS: one int32 of four e4m3 bytes ($2) times its tile's scale ($3: bf16x2 2**(e - 127), twice) -> two int32 of
# bf16x2 ($0: values 0-1, $1: values 2-3), exactly: e4m3 -> f16 (exact, subnormals included), the f16 bits moved
# into bf16's fields (the value x 2**-112: the exponent biases differ by 112; zero stays zero), then x 2**112 and x
# the scale, both powers of two in bf16. 16 instructions a word, where the byte path extracts each byte, widens it to
# f32, multiplies and narrows (sm_120a: 690 loop instructions a warp against 781). An e4m3 NaN byte (SGLang's
# quantiser writes none) comes out finite.
E4M3_WORD = gl.constexpr("""{
.reg .b16 l, h;
.reg .b32 a, b, sa, sb, up;
mov.b32 up, 0x77807780;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
shr.b32 sa, a, 3;
shr.b32 sb, b, 3;
and.b32 sa, sa, 0x0fff0fff;
and.b32 sb, sb, 0x0fff0fff;
and.b32 a, a, 0x80008000;
and.b32 b, b, 0x80008000;
or.b32 a, a, sa;
or.b32 b, b, sb;
mul.rn.bf16x2 a, a, up;
mul.rn.bf16x2 b, b, up;
mul.rn.bf16x2 $0, a, $3;
mul.rn.bf16x2 $1, b, $3;
}""")


@gluon.jit
def _dequant(nope, rope, sc, IS_FP8: gl.constexpr, WORDS: gl.constexpr, BN: gl.constexpr):
    """A block's rows from `_load_raw`'s registers (e4m3 x 2**(ue8m0 - 127) per 64-dim tile, exact in bf16, and the
    bf16 RoPE tile): bf16 [BN, 512], or with WORDS int32 [BN, 256] of bf16 pairs (`_stage_store` stores either)."""
    t = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, nope.type.layout)))
    if IS_FP8 and WORDS:
        e = sc.to(gl.int32) & 0xFF
        lo, hi = gl.inline_asm_elementwise(E4M3_WORD, "=r,=r,r,r", [nope, ((e << 7) | (e << 23))[:, :, None]],
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        is_nope = (t < 7)[None, :, None]
        lo = gl.where(is_nope, lo, (rope & 0xFFFFFFFF).to(gl.int32))
        hi = gl.where(is_nope, hi, (rope >> 32).to(gl.int32))
        rows = gl.reshape(gl.join(lo, hi), [BN, 256])
    elif IS_FP8:
        scale = gl.exp2(sc.to(gl.float32) - 127.0)
        vals = nope.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None]
        rows = gl.reshape(gl.where((t < 7)[None, :, None], vals, rope.to(gl.float32)).to(gl.bfloat16), [BN, 512])
    else:
        rows = gl.reshape(nope.to(gl.bfloat16), [BN, 512])
    return rows


@gluon.jit
def _stage_store(stage, rows, BN: gl.constexpr):
    """Store a block's rows into a [BN, 512] bf16 stage: bf16 as they are, int32 pairs through an int32 view of the
    same bytes (the 128-byte swizzle maps a 32-bit word of bf16 pairs as it maps the pair)."""
    if rows.dtype == gl.int32:
        stage._reinterpret(gl.int32, [BN, 256],
                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)).store(rows)
    else:
        stage.store(rows)


@gluon.jit
def _scaled(alpha, o0, o1, o2, o3):
    """O's four 128-column accumulators, each row scaled by alpha (the online softmax's move of its reference max)."""
    return o0 * alpha[:, None], o1 * alpha[:, None], o2 * alpha[:, None], o3 * alpha[:, None]


@gluon.jit
def _pv(p, stage, o0, o1, o2, o3, dot_a: gl.constexpr, dot_b: gl.constexpr, DC: gl.constexpr):
    """O_c += P V[:, c] over one stage's rows, P converted once to the A-operand layout."""
    p_op = gl.convert_layout(p.to(gl.bfloat16), dot_a)
    o0 = mma_v2(p_op, stage.slice(0 * DC, DC, dim=1).load(dot_b), o0)
    o1 = mma_v2(p_op, stage.slice(1 * DC, DC, dim=1).load(dot_b), o1)
    o2 = mma_v2(p_op, stage.slice(2 * DC, DC, dim=1).load(dot_b), o2)
    o3 = mma_v2(p_op, stage.slice(3 * DC, DC, dim=1).load(dot_b), o3)
    return o0, o1, o2, o3


@gluon.jit
def _epilogue(o0, o1, o2, o3, m_i, l_acc, b, split, num_splits, part_o_ptr, part_lse_ptr, sink_ptr, out_ptr,
              stride_ob, stride_oh, lse_ptr, stride_lb, H: gl.constexpr, DC: gl.constexpr, SPLIT_OUT: gl.constexpr,
              HAS_SINK: gl.constexpr, row_l: gl.constexpr, col_l: gl.constexpr):
    """O / l and the lse of a split (part_o [B, splits, H, 512], part_lse) or of the query (the sink applied)."""
    lse, inv = lse_and_inverse(m_i, gl.sum(l_acc, axis=1))
    offs_h = gl.arange(0, H, layout=row_l)
    offs_d = gl.arange(0, DC, layout=col_l)
    if SPLIT_OUT:
        row = (b * num_splits + split).to(gl.int64) * H + offs_h
        base = part_o_ptr + row[:, None] * D_ALL + offs_d[None, :]
        gl.store(base + 0 * DC, o0 * inv[:, None])
        gl.store(base + 1 * DC, o1 * inv[:, None])
        gl.store(base + 2 * DC, o2 * inv[:, None])
        gl.store(base + 3 * DC, o3 * inv[:, None])
        gl.store(part_lse_ptr + row, lse)
    else:
        if HAS_SINK:
            inv = inv / (1.0 + gl.exp(gl.load(sink_ptr + offs_h) - lse))
        base = out_ptr + b.to(gl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
        ty = out_ptr.dtype.element_ty
        gl.store(base + 0 * DC, (o0 * inv[:, None]).to(ty))
        gl.store(base + 1 * DC, (o1 * inv[:, None]).to(ty))
        gl.store(base + 2 * DC, (o2 * inv[:, None]).to(ty))
        gl.store(base + 3 * DC, (o3 * inv[:, None]).to(ty))
        gl.store(lse_ptr + b * stride_lb + offs_h, lse)


@gluon.jit
def _sparse_decode_mma_v2_kernel(
    q_ptr, stride_qb, stride_qh,
    kv_ptr, stride_kv, ekv_ptr, stride_ekv,
    widx_ptr, stride_wb, W, eidx_ptr, stride_eb, K,
    wlen_ptr, elen_ptr, sink_ptr,
    out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
    part_o_ptr, part_lse_ptr,
    qk_scale_log2, num_splits,
    H: gl.constexpr, BN: gl.constexpr, SPLIT_OUT: gl.constexpr,
    IS_FP8: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_WLEN: gl.constexpr, HAS_ELEN: gl.constexpr,
    HAS_SINK: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr,
    WORDS: gl.constexpr = False, LAZY: gl.constexpr = False,
):
    NW: gl.constexpr = gl.num_warps()
    WM: gl.constexpr = H // 16
    WN: gl.constexpr = NW // WM
    DC: gl.constexpr = 128  # O's column chunk (an accumulator of its own)
    KB: gl.constexpr = 128  # dims of one of S's four mma.sync chains
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WM, WN], instr_shape=[16, 8])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    # [BN, 8 tiles, 64 dims]: 16 bytes (fp8) or 16 values a thread along the dims
    # [BN, 8 tiles, 64 dims] (16 bytes or values a thread) or, WORDS, [BN, 8 tiles, 16 words] (4 words a thread)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4 if WORDS and IS_FP8 else 16], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    b = gl.program_id(0)
    split = gl.program_id(1)
    lo, hi, nbw, wlen, elen = _block_range(b, split, num_splits, W, K, wlen_ptr, elen_ptr, BN,
                                           HAS_EXTRA, HAS_WLEN, HAS_ELEN, 1, False)
    widx_row = widx_ptr + b.to(gl.int64) * stride_wb
    eidx_row = eidx_ptr + b.to(gl.int64) * stride_eb

    LR: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    offs_r = gl.arange(0, BN, layout=LR)
    offs_c = gl.arange(0, BN, layout=col_l)
    # Pipeline, per block j: its products read stage j % 2 while block j + 1 is dequantised in registers (the
    # ALU work overlaps the mma.sync), then stored to the other stage (read last by block j - 1, before the
    # barrier that ended it); block j + 2's rows and block j + 3's indices are loaded meanwhile. A warp issues
    # in order, so a load is only ever waited for an iteration after it went out.
    idx_r = _block_indices(lo, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    nope, rope, sc = _load_raw(lo, nbw, idx_r, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                               W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    idx_r = _block_indices(lo + 1, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    nope_n, rope_n, sc_n = _load_raw(lo + 1, nbw, idx_r, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                                     W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    idx_r_nn = _block_indices(lo + 2, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    idx_c = _block_indices(lo, hi, nbw, wlen, elen, widx_row, eidx_row, offs_c, BN)
    qh = gl.arange(0, H, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, D_ALL, layout=gl.SliceLayout(0, q_l))
    q = gl.load(q_ptr + b.to(gl.int64) * stride_qb + qh[:, None] * stride_qh + qd[None, :])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D_ALL], smem_l, q.to(gl.bfloat16))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D_ALL], smem_l)
    _stage_store(k_smem.index(0), _dequant(nope, rope, sc, IS_FP8, WORDS, BN), BN)
    gl.barrier()

    m_i = gl.full([H], float("-inf"), gl.float32, layout=row_l)
    l_acc = gl.zeros([H, BN], gl.float32, layout=mma)
    o0 = gl.zeros([H, DC], gl.float32, layout=mma)
    o1 = gl.zeros([H, DC], gl.float32, layout=mma)
    o2 = gl.zeros([H, DC], gl.float32, layout=mma)
    o3 = gl.zeros([H, DC], gl.float32, layout=mma)
    for j in range(lo, hi):
        stage = k_smem.index((j - lo) % 2)
        kt = stage.permute((1, 0))
        # S = Q K^T as four independent chains of mma.sync (one per 128 dims), not one chain of 32
        s0 = gl.zeros([H, BN], gl.float32, layout=mma)
        s1 = gl.zeros([H, BN], gl.float32, layout=mma)
        s2 = gl.zeros([H, BN], gl.float32, layout=mma)
        s3 = gl.zeros([H, BN], gl.float32, layout=mma)
        for kb in gl.static_range(KB // 16):
            s0 = mma_v2(q_smem.slice(0 * KB + kb * 16, 16, dim=1).load(dot_a),
                        kt.slice(0 * KB + kb * 16, 16, dim=0).load(dot_b), s0)
            s1 = mma_v2(q_smem.slice(1 * KB + kb * 16, 16, dim=1).load(dot_a),
                        kt.slice(1 * KB + kb * 16, 16, dim=0).load(dot_b), s1)
            s2 = mma_v2(q_smem.slice(2 * KB + kb * 16, 16, dim=1).load(dot_a),
                        kt.slice(2 * KB + kb * 16, 16, dim=0).load(dot_b), s2)
            s3 = mma_v2(q_smem.slice(3 * KB + kb * 16, 16, dim=1).load(dot_a),
                        kt.slice(3 * KB + kb * 16, 16, dim=0).load(dot_b), s3)
        rows_n = _dequant(nope_n, rope_n, sc_n, IS_FP8, WORDS, BN)
        nope_n, rope_n, sc_n = _load_raw(j + 2, nbw, idx_r_nn, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8,
                                         WORDS, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
        idx_r_nn = _block_indices(j + 3, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
        s = (s0 + s1) + (s2 + s3)
        s = gl.where((idx_c >= 0)[None, :], s * qk_scale_log2, float("-inf"))
        idx_c = _block_indices(j + 1, hi, nbw, wlen, elen, widx_row, eidx_row, offs_c, BN)
        m_blk = gl.max(s, axis=1)
        if LAZY:
            # The reference max moves only when some head's block max passes it by more than 2**LAZY_LOG2 (so p
            # stays <= 256), a decision of the whole CTA: most blocks then skip O's and l's rescale (128 + 8
            # FMUL a thread a block at 8 warps). O / l and the lse are the same sums under any reference.
            grow = gl.max((m_blk > m_i + LAZY_LOG2).to(gl.int32), axis=0)
            if grow > 0:
                m_new = gl.maximum(m_i, m_blk)
                alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
                o0, o1, o2, o3 = _scaled(alpha, o0, o1, o2, o3)
                l_acc = l_acc * alpha[:, None]
                m_i = m_new
            p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_acc = l_acc + p
        else:
            m_new = gl.maximum(m_i, m_blk)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l_acc = l_acc * alpha[:, None] + p
            o0, o1, o2, o3 = _scaled(alpha, o0, o1, o2, o3)
            m_i = m_new
        o0, o1, o2, o3 = _pv(p, stage, o0, o1, o2, o3, dot_a, dot_b, DC)
        _stage_store(k_smem.index((j - lo + 1) % 2), rows_n, BN)
        gl.barrier()

    _epilogue(o0, o1, o2, o3, m_i, l_acc, b, split, num_splits, part_o_ptr, part_lse_ptr, sink_ptr, out_ptr,
              stride_ob, stride_oh, lse_ptr, stride_lb, H, DC, SPLIT_OUT, HAS_SINK, row_l, col_l)
