"""Warp-specialised sparse MLA decode for Hopper at 16 real heads (TP4), in Gluon: the wgmma kernel of
`gluon_kernel.py` with A and B swapped, so that the 16 heads are wgmma's N instead of a padded M = 64.

    loader      (LOADER_WARPS warps, `gluon_loaders.loader_partition`, the 64-head kernel's): Q (16 x 512) and the
                index table, then per block the rows, dequantised into bf16 stage i % NS; signals `full[s]`.
    compute     (one warpgroup, the default partition) per block: S^T = K Q^T ([BN, 16], M = the block's rows),
                the online softmax down S^T's columns (one per head), P^T into shared memory, then
                O^T = V^T P^T ([512, 16]: the stage read transposed as wgmma's A). O^T is 64 fp32 registers a
                thread, so the loader can have more warps than the 64-head kernel's four.

One CTA per (query, split), ~150 KB of shared memory, so one an SM; the last split of a query to finish merges them
(`_arrive`, `_merge_into`; `LaunchConfig(fused_merge=False)`: the merge kernel after it). A query's n live blocks go
to n // min_per of the launch's splits (`gluon_kernel._split_share`, `splits.h16_min_blocks`): the launch's count
follows the configured width, which SGLang's ratio-128 list keeps at context / 128. Semantics are those of
`reference.py` (live block j < nbw is window block j, else extra block j - nbw, as in `kernel.py`). Measured (H100,
Triton 3.8.0, graph replay, SGLang's calls at 16 real heads, x FlashMLA, which computes 64, at B = 32 / 64 / 128 /
256; bench/results/sglang_decode.md): ratio 4 1.36 / 1.81 / 1.41 / 1.46, window 1.28 / 1.33 / 1.43 / 1.42. 8 loader
warps beat 4 (ratio 4, B = 128: 1.41 against 1.29); below B = 32 the mma.sync kernel is faster (the dispatch table's
`min_batch`). Why the 64-head kernel cannot take the same loader: DEVELOPERS.md, "16 heads at B >= 128".
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

from .gluon_epilogue import COUNTER_STRIDE, lse_and_inverse
from .gluon_kernel import _block_range, _split_share
from .gluon_loaders import D_ALL, loader_partition

H16 = gl.constexpr(16)


@gluon.jit
def _compute_h16(b, split, num_splits, lo, hi, nbw, wlen, elen, qk_scale_log2,
                 sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr, counter_ptr,
                 q_smem, k_smem, idx_all, pt_smem, q_bar, full, empty,
                 BN: gl.constexpr, NS: gl.constexpr, SPLIT_OUT: gl.constexpr, HAS_SINK: gl.constexpr,
                 FUSE_MERGE: gl.constexpr, min_per):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    rows: gl.constexpr = gl.SliceLayout(1, s_l)   # along a block's rows (S^T's M) or O^T's dims
    heads: gl.constexpr = gl.SliceLayout(0, s_l)  # along the heads (N)
    m_i = gl.full([H16], float("-inf"), gl.float32, layout=heads)
    l_acc = gl.zeros([BN, H16], gl.float32, layout=s_l)
    acc = gl.zeros([D_ALL, H16], gl.float32, layout=s_l)
    s_zero = gl.zeros([BN, H16], gl.float32, layout=s_l)
    offs_r = gl.arange(0, BN, layout=rows)
    mbarrier.wait(q_bar, 0)
    for j in range(lo, hi):
        i = j - lo
        s = i % NS
        mbarrier.wait(full.index(s), (i // NS) & 1)
        fence_async_shared()
        k = k_smem.index(s)
        st = warpgroup_mma(k, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
        idx = idx_all.index(j).load(rows)  # the loader staged the table by the query's lengths: row j = block j
        is_w = j < nbw
        n_valid = gl.where(is_w, wlen, elen)
        valid = (idx >= 0) & (gl.where(is_w, j, j - nbw) * BN + offs_r < n_valid)
        st = gl.where(valid[:, None], st * qk_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(st, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(st - m_safe[None, :])
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        pt_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()  # P^T is read by the wgmma below (async proxy)
        gl.barrier()
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(k.permute((1, 0)), pt_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s))

    lse, inv = lse_and_inverse(m_i, gl.sum(l_acc, axis=0))
    offs_h = gl.arange(0, H16, layout=heads)
    offs_d = gl.arange(0, D_ALL, layout=rows)
    if SPLIT_OUT:
        o = acc * inv[None, :]
        row = (b * num_splits + split).to(gl.int64) * H16 + offs_h  # part_o [B, splits, 16, 512]
        if FUSE_MERGE:
            # the splits that got rows (`_block_range`: `_split_share` blocks each, from split 0): 0 or 1 of
            # them, split 0 writes the output; else each stores its partial and the last to arrive merges them
            nlive = nbw + (elen + BN - 1) // BN
            per = gl.maximum(_split_share(nlive, num_splits, min_per, True), 1)
            live = (nlive + per - 1) // per
            if live <= 1:
                if split == 0:
                    _store_out(acc, lse, inv, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr,
                               stride_lb, HAS_SINK)
            elif split < live:
                gl.store(part_o_ptr + row[None, :] * D_ALL + offs_d[:, None], o)
                gl.store(part_lse_ptr + row, lse)
                if _arrive(counter_ptr + COUNTER_STRIDE * b) == live - 1:
                    _merge_into(b, num_splits, live, part_o_ptr, part_lse_ptr, sink_ptr, out_ptr, stride_ob, stride_oh,
                                lse_ptr, stride_lb, HAS_SINK)
                    _reset(counter_ptr + COUNTER_STRIDE * b)
        else:
            gl.store(part_o_ptr + row[None, :] * D_ALL + offs_d[:, None], o)
            gl.store(part_lse_ptr + row, lse)
    else:
        _store_out(acc, lse, inv, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
                   HAS_SINK)


@gluon.jit
def _store_out(acc, lse, inv, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
               HAS_SINK: gl.constexpr):
    """The query's output, acc [512, 16] x inv per head (x the sink's factor), and its lse."""
    if HAS_SINK:
        inv = inv / (1.0 + gl.exp(gl.load(sink_ptr + offs_h) - lse))
    base = out_ptr + b.to(gl.int64) * stride_ob + offs_h[None, :] * stride_oh + offs_d[:, None]
    gl.store(base, (acc * inv[None, :]).to(out_ptr.dtype.element_ty))
    gl.store(lse_ptr + b * stride_lb + offs_h, lse)


# The in-kernel merge of a query's splits, as CUTLASS's split-K semaphore publishes a CTA's stores: each split with
# rows stores its partial, the CTA meets at a barrier, then one thread counts the split in on the query's counter
# (atom.acq_rel.gpu: its release carries the whole CTA's stores, ordered before it by the barrier); the split that
# sees live - 1 earlier arrivals is the last, and after the barrier inside the reduction that hands every thread the
# count (ordered after that thread's acquire) it merges all the partials (`_merge_into`) and zeroes the counter for
# the next launch. Nobody waits, so no split needs another to be resident (unlike the 64-head kernel's barrier,
# `gluon_epilogue._SPLIT_BARRIER`). A first version fenced every thread (fence.acq_rel.gpu) on both sides and read
# the partials in the accumulator's layout (64 scalar loads a thread a split): slower than the merge kernel in
# SGLang's step (bench/results/ab_h16_fused/).
_COUNT_IN = gl.constexpr("""{
.reg .pred p;
setp.eq.u32 p, $2, 0;
mov.u32 $0, 0;
@p atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;
}""")


@gluon.jit
def _arrive(counter_ptr):
    """Count this CTA's split in; the arrivals before it (the same value in every thread)."""
    NW: gl.constexpr = gl.num_warps()
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    lanes = gl.arange(0, 32 * NW, layout=one_l)
    gl.barrier()
    old = gl.inline_asm_elementwise(_COUNT_IN, "=r,l,r", [counter_ptr + lanes * 0, lanes], dtype=gl.int32,
                                    is_pure=False, pack=1)
    return gl.max(old, axis=0)


@gluon.jit
def _reset(counter_ptr):
    NW: gl.constexpr = gl.num_warps()
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    lanes = gl.arange(0, 32 * NW, layout=one_l)
    gl.store(counter_ptr + lanes * 0, lanes * 0, mask=lanes == 0)


@gluon.jit
def _merge_into(b, num_splits, live, part_o_ptr, part_lse_ptr, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr,
                stride_lb, HAS_SINK: gl.constexpr):
    """The last split's merge of the query's `live` partials (its own included) into the output, weighted by
    exp(lse), read from L2 (.cg: other SMs wrote them during this launch) in a layout along the dims: 4 a thread,
    a warp's 128 contiguous (512 B a head), 16-byte loads; the output goes out 8 bytes a thread the same way."""
    NW: gl.constexpr = gl.num_warps()
    bl: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NW], [0, 1])  # [512 dims, 16 heads]
    offs_h = gl.arange(0, H16, layout=gl.SliceLayout(0, bl))
    offs_d = gl.arange(0, D_ALL, layout=gl.SliceLayout(1, bl))
    m = gl.full([H16], float("-inf"), gl.float32, layout=gl.SliceLayout(0, bl))
    w = gl.zeros([H16], gl.float32, layout=gl.SliceLayout(0, bl))
    o = gl.zeros([D_ALL, H16], gl.float32, layout=bl)
    for s in range(0, live):
        row = (b * num_splits + s).to(gl.int64) * H16 + offs_h
        lse_s = gl.load(part_lse_ptr + row, cache_modifier=".cg")
        o_s = gl.load(part_o_ptr + row[None, :] * D_ALL + offs_d[:, None], mask=(lse_s > float("-inf"))[None, :],
                      other=0.0, cache_modifier=".cg")
        m_new = gl.maximum(m, lse_s)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        a = gl.exp(m - m_safe)
        c = gl.exp(lse_s - m_safe)
        w = w * a + c
        o = o * a[None, :] + o_s * c[None, :]
        m = m_new
    has_any = w > 0
    w_safe = gl.where(has_any, w, 1.0)
    lse = gl.where(has_any, gl.where(m == float("-inf"), 0.0, m) + gl.log(w_safe), float("-inf"))
    _store_out(o, lse, 1.0 / w_safe, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
               HAS_SINK)


@gluon.jit
def _sparse_decode_h16_kernel(
    q_ptr, stride_qb, stride_qh,
    kv_ptr, stride_kv, ekv_ptr, stride_ekv,
    widx_ptr, stride_wb, W, eidx_ptr, stride_eb, K,
    wlen_ptr, elen_ptr, sink_ptr,
    out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
    part_o_ptr, part_lse_ptr, counter_ptr,
    qk_scale_log2, num_splits, min_per,
    BN: gl.constexpr, NS: gl.constexpr, SPLIT_OUT: gl.constexpr, FUSE_MERGE: gl.constexpr,
    IS_FP8: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_WLEN: gl.constexpr, HAS_ELEN: gl.constexpr,
    HAS_SINK: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr, E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr,
    LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, MAXB: gl.constexpr,
):
    b = gl.program_id(0)
    split = gl.program_id(1)
    lo, hi, nbw, wlen, elen = _block_range(b, split, num_splits, W, K, wlen_ptr, elen_ptr, BN,
                                           HAS_EXTRA, HAS_WLEN, HAS_ELEN, min_per, True)
    nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [H16, D_ALL], nvmma)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, D_ALL], nvmma)
    idx_all = gl.allocate_shared_memory(gl.int32, [MAXB, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    pt_smem = gl.allocate_shared_memory(gl.bfloat16, [H16, BN], gl.NVMMASharedLayout.get_default_for([H16, BN],
                                                                                                     gl.bfloat16))
    t_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(t_bar, count=LOADER_WARPS * 32)
    mbarrier.init(q_bar, count=LOADER_WARPS * 32)
    for s in gl.static_range(NS):
        mbarrier.init(full.index(s), count=1 if IS_FP8 else LOADER_WARPS * 32)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_compute_h16, (b, split, num_splits, lo, hi, nbw, wlen, elen, qk_scale_log2,
                        sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, part_o_ptr, part_lse_ptr,
                        counter_ptr, q_smem, k_smem, idx_all, pt_smem, q_bar, full, empty, BN, NS, SPLIT_OUT,
                        HAS_SINK, FUSE_MERGE, min_per)),
        (loader_partition, (q_ptr, stride_qb, stride_qh, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                            widx_ptr, stride_wb, eidx_ptr, stride_eb, b, lo, hi, nbw, nbw, wlen, elen,
                            q_smem, k_smem, idx_all, t_bar, q_bar, full, empty,
                            BN, NS, MAXB, IS_FP8, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE, False)),
    ], [LOADER_WARPS], [LOADER_REGS])
