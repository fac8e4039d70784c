"""The mma.sync sparse decode (`gluon_mma_v2.py`) taking a split's blocks two at a time: blocks j and j + 1 in the
two stages, each Q fragment read from shared memory once for both blocks' S (two chains of 256 dims a block), and the
softmax, its CTA-wide reductions and the barriers once a pair. The next pair's rows are loaded an iteration ahead
and dequantised and stored after the barrier that ends the pair; past the split's last block a block has no valid
rows, so an odd count's last half is empty. Same arguments, semantics and outputs as `gluon_mma_v2`'s kernel; 255
registers, no spill and 100,352 B as compiled for sm_120a (fp8 in words, 8 warps, 64 heads: what the plan launches
it for, `plan._pairs`).

Why: Q's fragments were two thirds of S's shared-memory wavefronts (bench/results/ncu_sm120_mma_v2_c4_b128.txt) and
S 38.5 of the one-block kernel's 100 us at c4 B = 128 (sm120_mma_v2_ablation.md). H100 standing in, forced sm_120,
Triton 3.8.0, graph, c4 64 heads B = 32 / 48 / 64 / 96 / 128: 39.7 / 55.3 / 57.6 / 88.0 / 89.9 us against 41.1 /
59.9 / 62.0 / 98.5 / 100.1 (the plan's choice against the one-block kernel, one call); slower where a split has few
live blocks (c4 B = 16, 5 a split: 30.8 against 29.6; ratio-128 with 9 live: 39.1 against 37.1), hence the plan's
floor and its ratio-4 condition.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .gluon_kernel import _block_range
from .gluon_mma_v2 import (D_ALL, LAZY_LOG2, _block_indices, _dequant, _epilogue, _load_raw, _pv, _scaled,
                           _stage_store)


@gluon.jit
def _sparse_decode_mma_v2_pair_kernel(
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
    DC: gl.constexpr = 128
    KB: gl.constexpr = 256  # dims of one of S's two chains per block
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WM, WN], instr_shape=[16, 8])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
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
    # the pair (lo, lo + 1) to the stages; (lo + 2, lo + 3) loaded into registers; the indices of the pair after
    idx_r = _block_indices(lo, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    na, ra, sa = _load_raw(lo, nbw, idx_r, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                           W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    idx_r = _block_indices(lo + 1, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    nb, rb, sb = _load_raw(lo + 1, nbw, idx_r, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                           W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    qh = gl.arange(0, H, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, D_ALL, layout=gl.SliceLayout(0, q_l))
    q = gl.load(q_ptr + b.to(gl.int64) * stride_qb + qh[:, None] * stride_qh + qd[None, :])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, D_ALL], smem_l, q.to(gl.bfloat16))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D_ALL], smem_l)
    _stage_store(k_smem.index(0), _dequant(na, ra, sa, IS_FP8, WORDS, BN), BN)
    _stage_store(k_smem.index(1), _dequant(nb, rb, sb, IS_FP8, WORDS, BN), BN)
    idx_r = _block_indices(lo + 2, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    na, ra, sa = _load_raw(lo + 2, nbw, idx_r, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                           W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    idx_r = _block_indices(lo + 3, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    nb, rb, sb = _load_raw(lo + 3, nbw, idx_r, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                           W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    idx_ra = _block_indices(lo + 4, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    idx_rb = _block_indices(lo + 5, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
    idx_ca = _block_indices(lo, hi, nbw, wlen, elen, widx_row, eidx_row, offs_c, BN)
    idx_cb = _block_indices(lo + 1, hi, nbw, wlen, elen, widx_row, eidx_row, offs_c, BN)
    gl.barrier()

    m_i = gl.full([H], float("-inf"), gl.float32, layout=row_l)
    l_acc = gl.zeros([H, BN], gl.float32, layout=mma)
    o0 = gl.zeros([H, DC], gl.float32, layout=mma)
    o1 = gl.zeros([H, DC], gl.float32, layout=mma)
    o2 = gl.zeros([H, DC], gl.float32, layout=mma)
    o3 = gl.zeros([H, DC], gl.float32, layout=mma)
    stage_a = k_smem.index(0)
    stage_b = k_smem.index(1)
    kta = stage_a.permute((1, 0))
    ktb = stage_b.permute((1, 0))
    for j in range(lo, hi, 2):
        sa0 = gl.zeros([H, BN], gl.float32, layout=mma)
        sa1 = gl.zeros([H, BN], gl.float32, layout=mma)
        sb0 = gl.zeros([H, BN], gl.float32, layout=mma)
        sb1 = gl.zeros([H, BN], gl.float32, layout=mma)
        for kb in gl.static_range(KB // 16):
            q0 = q_smem.slice(0 * KB + kb * 16, 16, dim=1).load(dot_a)
            sa0 = mma_v2(q0, kta.slice(0 * KB + kb * 16, 16, dim=0).load(dot_b), sa0)
            sb0 = mma_v2(q0, ktb.slice(0 * KB + kb * 16, 16, dim=0).load(dot_b), sb0)
            q1 = q_smem.slice(1 * KB + kb * 16, 16, dim=1).load(dot_a)
            sa1 = mma_v2(q1, kta.slice(1 * KB + kb * 16, 16, dim=0).load(dot_b), sa1)
            sb1 = mma_v2(q1, ktb.slice(1 * KB + kb * 16, 16, dim=0).load(dot_b), sb1)
        s_a = gl.where((idx_ca >= 0)[None, :], (sa0 + sa1) * qk_scale_log2, float("-inf"))
        s_b = gl.where((idx_cb >= 0)[None, :], (sb0 + sb1) * qk_scale_log2, float("-inf"))
        idx_ca = _block_indices(j + 2, hi, nbw, wlen, elen, widx_row, eidx_row, offs_c, BN)
        idx_cb = _block_indices(j + 3, hi, nbw, wlen, elen, widx_row, eidx_row, offs_c, BN)
        m_blk = gl.max(gl.maximum(s_a, s_b), axis=1)
        if LAZY:
            grow = gl.max((m_blk > m_i + LAZY_LOG2).to(gl.int32), axis=0)
            if grow > 0:
                m_new = gl.maximum(m_i, m_blk)
                alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
                o0, o1, o2, o3 = _scaled(alpha, o0, o1, o2, o3)
                l_acc = l_acc * alpha[:, None]
                m_i = m_new
            m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)[:, None]
            p_a = gl.exp2(s_a - m_safe)
            p_b = gl.exp2(s_b - m_safe)
            l_acc = l_acc + (p_a + p_b)
        else:
            m_new = gl.maximum(m_i, m_blk)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p_a = gl.exp2(s_a - m_safe[:, None])
            p_b = gl.exp2(s_b - m_safe[:, None])
            l_acc = l_acc * alpha[:, None] + (p_a + p_b)
            o0, o1, o2, o3 = _scaled(alpha, o0, o1, o2, o3)
            m_i = m_new
        o0, o1, o2, o3 = _pv(p_a, stage_a, o0, o1, o2, o3, dot_a, dot_b, DC)
        o0, o1, o2, o3 = _pv(p_b, stage_b, o0, o1, o2, o3, dot_a, dot_b, DC)
        gl.barrier()   # every warp is done with the pair's stages
        _stage_store(stage_a, _dequant(na, ra, sa, IS_FP8, WORDS, BN), BN)
        _stage_store(stage_b, _dequant(nb, rb, sb, IS_FP8, WORDS, BN), BN)
        na, ra, sa = _load_raw(j + 4, nbw, idx_ra, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                               W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
        nb, rb, sb = _load_raw(j + 5, nbw, idx_rb, kv_ptr, stride_kv, ekv_ptr, stride_ekv, L3, IS_FP8, WORDS,
                               W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
        idx_ra = _block_indices(j + 6, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
        idx_rb = _block_indices(j + 7, hi, nbw, wlen, elen, widx_row, eidx_row, offs_r, BN)
        gl.barrier()

    _epilogue(o0, o1, o2, o3, m_i, l_acc, b, split, num_splits, part_o_ptr, part_lse_ptr, sink_ptr, out_ptr,
              stride_ob, stride_oh, lse_ptr, stride_lb, H, DC, SPLIT_OUT, HAS_SINK, row_l, col_l)
