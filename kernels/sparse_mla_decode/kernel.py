"""Triton kernels of sparse MLA decode: all heads of a query in one program, split-K, combine.

Why one program per (query, split) with every head in it: all 64 heads share one KV head, so a
tile of selected rows is loaded once and used by one [H, 512] x [512, BN] tensor-core product; a
per-head kernel would read every row 64 times. Split-K over the selected rows keeps the machine
busy at small batches; `_combine_kernel` merges the splits by their log-sum-exp.

Work is O(live rows): a program walks only the blocks below the query's valid lengths, so the
grid can be sized once for CUDA-graph capture. Nothing here syncs with the host.

Rows come from two caches (window rows, then extra rows): live block j < nbw is a window block,
otherwise an extra block; both are read through one selected base pointer. Two row formats:
bf16/fp16 rows [N, 512] (any row stride), or the V4 fp8 pages of `fp8_layout`, dequantised in
registers (e4m3 x 2**(ue8m0 - 127) for 7 tiles of 64 dims, bf16 RoPE for the last 64).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_rows(base, row_stride, idx, valid, out_t: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
               IS_FP8: tl.constexpr, shift, page_bytes):
    """[BN, D] rows `idx` of one cache in dtype out_t (zeros where not valid). fp8: pages of 2**shift
    tokens, page_bytes apart, the scales after the page's 576-B records."""
    if IS_FP8:
        page = idx >> shift
        slot = idx & ((1 << shift) - 1)
        page_base = base + page.to(tl.int64) * page_bytes
        rec = page_base + slot * 576
        t = tl.arange(0, 8)
        c = tl.arange(0, 64)
        is_nope = (t < 7)[None, :, None]
        v3 = valid[:, None, None]
        nope = tl.load(rec[:, None, None] + (t[None, :, None] * 64 + c[None, None, :]),
                       mask=v3 & is_nope, other=0)
        nope = nope.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = tl.load((page_base + (576 << shift) + slot * 8)[:, None] + t[None, :],
                     mask=valid[:, None] & (t < 7)[None, :], other=127)
        sc = tl.exp2(sc.to(tl.float32) - 127.0)
        rope_ptr = (rec + 448).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        rope = tl.load(rope_ptr[:, None] + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        rows = tl.where(is_nope, nope * sc[:, :, None], rope[:, None, :])
        return tl.reshape(rows.to(out_t), (BN, D))
    else:
        d = tl.arange(0, D)
        ptrs = base + idx.to(tl.int64)[:, None] * row_stride + d[None, :]
        return tl.load(ptrs, mask=valid[:, None], other=0.0).to(out_t)


@triton.jit
def _fetch_block(j, hi, nbw, wlen, elen, widx_row, eidx_row, kv_ptr, stride_kv, ekv_ptr, stride_ekv,
                 out_t: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, IS_FP8: tl.constexpr,
                 W_SHIFT: tl.constexpr, W_PAGE: tl.constexpr, E_SHIFT: tl.constexpr, E_PAGE: tl.constexpr):
    """Live block j of a query: window block j if j < nbw, else extra block j - nbw. Rows [BN, D] + validity."""
    is_w = j < nbw
    pos = tl.where(is_w, j, j - nbw) * BN + tl.arange(0, BN)
    n_valid = tl.where(j < hi, tl.where(is_w, wlen, elen), 0)  # block hi (a prefetch past the end) is empty
    idx = tl.load(tl.where(is_w, widx_row, eidx_row) + pos, mask=pos < n_valid, other=-1)
    valid = idx >= 0
    base = tl.where(is_w, kv_ptr, ekv_ptr)
    row_stride = tl.where(is_w, stride_kv, stride_ekv)
    shift = tl.where(is_w, W_SHIFT, E_SHIFT)
    page_bytes = tl.where(is_w, W_PAGE, E_PAGE)
    return _load_rows(base, row_stride, idx, valid, out_t, D, BN, IS_FP8, shift, page_bytes), valid


@triton.jit
def _sparse_decode_kernel(
    q_ptr, stride_qb, stride_qh,
    kv_ptr, stride_kv, ekv_ptr, stride_ekv,
    widx_ptr, stride_wb, W, eidx_ptr, stride_eb, K,
    wlen_ptr, elen_ptr, sink_ptr,
    out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
    part_o_ptr, part_lse_ptr,
    qk_scale_log2, num_splits,
    H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, SPLIT_OUT: tl.constexpr,
    IS_FP8: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_WLEN: tl.constexpr, HAS_ELEN: tl.constexpr,
    HAS_SINK: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr,
    W_SHIFT: tl.constexpr, W_PAGE: tl.constexpr, E_SHIFT: tl.constexpr, E_PAGE: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    # Head groups (grid axis 2, launch.head_group): this program computes heads [g * H, + H) of the query; the
    # groups read the same rows (the later ones mostly from L2). On sm_120 (mma.sync, the accumulator in
    # registers) a 64-head program spills ~4 KB a thread; a 16-head one spills nothing.
    g = tl.program_id(2)
    q_ptr += g * H * stride_qh
    out_ptr += g * H * stride_oh
    lse_ptr += g * H
    sink_ptr += g * H
    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D)

    wlen = W
    if HAS_WLEN:
        wlen = tl.minimum(tl.maximum(tl.load(wlen_ptr + b), 0), W)
    elen = 0
    if HAS_EXTRA:
        elen = K
        if HAS_ELEN:
            elen = tl.minimum(tl.maximum(tl.load(elen_ptr + b), 0), K)
    nbw = (wlen + BN - 1) // BN
    nlive = nbw + (elen + BN - 1) // BN
    per_split = (nlive + num_splits - 1) // num_splits
    lo = split * per_split
    hi = tl.minimum(lo + per_split, nlive)

    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :])
    dot_t = q.dtype
    if DOT_F32:
        dot_t = tl.float32
    q = q.to(dot_t)

    m_i = tl.full((H,), float("-inf"), tl.float32)
    l_i = tl.zeros((H,), tl.float32)
    acc = tl.zeros((H, D), tl.float32)
    widx_row = widx_ptr + b.to(tl.int64) * stride_wb
    eidx_row = eidx_ptr + b.to(tl.int64) * stride_eb
    if PREFETCH:
        k_next, valid_next = _fetch_block(lo, hi, nbw, wlen, elen, widx_row, eidx_row, kv_ptr, stride_kv,
                                          ekv_ptr, stride_ekv, dot_t, D, BN, IS_FP8, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)
    for j in range(lo, hi):
        if PREFETCH:  # issue block j + 1's loads before block j's math
            k = k_next
            valid = valid_next
            k_next, valid_next = _fetch_block(j + 1, hi, nbw, wlen, elen, widx_row, eidx_row, kv_ptr,
                                              stride_kv, ekv_ptr, stride_ekv, dot_t, D, BN, IS_FP8, W_SHIFT,
                                              W_PAGE, E_SHIFT, E_PAGE)
        else:
            k, valid = _fetch_block(j, hi, nbw, wlen, elen, widx_row, eidx_row, kv_ptr, stride_kv, ekv_ptr,
                                    stride_ekv, dot_t, D, BN, IS_FP8, W_SHIFT, W_PAGE, E_SHIFT, E_PAGE)

        if DOT_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if DOT_F32:
            acc = tl.dot(p, k, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(dot_t), k, acc)
        m_i = m_new

    has_any = l_i > 0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) * LN2, float("-inf"))
    if not SPLIT_OUT:
        _store_result(o, lse, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
                      True, HAS_SINK)
    else:
        row = ((b * num_splits + split) * tl.num_programs(2) + g).to(tl.int64) * H  # [B, splits, groups * H]
        tl.store(part_o_ptr + (row + offs_h[:, None]) * D + offs_d[None, :], o)
        tl.store(part_lse_ptr + row + offs_h, lse)


@triton.jit
def _split_weights(part_lse_ptr, b, num_splits, offs_h, H: tl.constexpr, SP: tl.constexpr):
    """For query b, heads offs_h: the partial rows [SP, HB], their weights exp(lse_s - max) (0 for empty or
    missing splits), that max (0 when no split has a row) and the weights' sum."""
    offs_s = tl.arange(0, SP)
    rows = (b * num_splits + offs_s).to(tl.int64)[:, None] * H + offs_h[None, :]  # [SP, HB]
    lse_s = tl.load(part_lse_ptr + rows, mask=(offs_s < num_splits)[:, None], other=float("-inf"))
    lse_max = tl.max(lse_s, axis=0)
    max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp(lse_s - max_safe[None, :])
    return rows, w, max_safe, tl.sum(w, axis=0)


@triton.jit
def _merged(o_sum, w_sum, max_safe):
    """The merged (out, lse) from the weighted sum of the partial outputs; (0, -inf) for an empty query."""
    has_any = w_sum > 0
    o = o_sum / tl.where(has_any, w_sum, 1.0)[:, None]
    return o, tl.where(has_any, max_safe + tl.log(tl.where(has_any, w_sum, 1.0)), float("-inf"))


@triton.jit
def _store_result(o, lse, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
                  write_lse, HAS_SINK: tl.constexpr):
    """Scale by the attention sink (if any), store out[b, offs_h, offs_d] and, if write_lse, lse[b, offs_h]."""
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h)
        o = o / (1.0 + tl.exp(sink - lse))[:, None]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty))
    if write_lse:
        tl.store(lse_ptr + b * stride_lb + offs_h, lse)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_lse_ptr, sink_ptr,
    out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, num_splits,
    H: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, DC: tl.constexpr, SP: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """Merge num_splits (<= SP) partial (out, lse) of query b for heads [hb*HB, +HB), dims [dc*DC, +DC).

    Every split's partial tile is loaded at once ([SP, HB, DC]), so the merge costs one round trip to
    L2, not one per split; the grid spreads the dims over programs to keep that tile small. Only splits with
    weight are read (a split with no rows, lse -inf, is never a NaN source). Many empty splits still cost: at a 1M
    configured context a ratio-128 call at B = 1 has 130 splits, and its merge took 2.5 us against 2.1 at 8K (12
    splits; H100, the 43-layer profile in docs/sglang.md), about the same as before the loads were masked."""
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    offs_d = tl.program_id(2) * DC + tl.arange(0, DC)
    rows, w, max_safe, w_sum = _split_weights(part_lse_ptr, b, num_splits, offs_h, H, SP)
    live = (tl.arange(0, SP) < num_splits)[:, None] & (w > 0)
    parts = tl.load(part_o_ptr + rows[:, :, None] * D + offs_d[None, None, :], mask=live[:, :, None], other=0.0)
    o, lse = _merged(tl.sum(w[:, :, None] * parts, axis=0), w_sum, max_safe)
    _store_result(o, lse, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
                  tl.program_id(2) == 0, HAS_SINK)


@triton.jit
def _combine_stream_kernel(
    part_o_ptr, part_lse_ptr, sink_ptr,
    out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb, num_splits,
    H: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, SP: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """Merge num_splits (<= SP) partial (out, lse) of query b, heads [hb * HB, hb * HB + HB), streaming the
    splits one [HB, D] tile at a time: fewer, larger programs; on the H200 the faster merge below 8 splits. A split
    without rows (weight 0) is not read."""
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * HB + tl.arange(0, HB)
    offs_d = tl.arange(0, D)
    _, _, max_safe, w_sum = _split_weights(part_lse_ptr, b, num_splits, offs_h, H, SP)
    o = tl.zeros((HB, D), tl.float32)
    for s in range(0, num_splits):  # stream the partial outputs: [HB, D] per split in registers
        row = (b * num_splits + s).to(tl.int64) * H + offs_h
        w_s = tl.exp(tl.load(part_lse_ptr + row) - max_safe)
        o += w_s[:, None] * tl.load(part_o_ptr + row[:, None] * D + offs_d[None, :], mask=(w_s > 0)[:, None], other=0.0)
    o, lse = _merged(o, w_sum, max_safe)
    _store_result(o, lse, b, offs_h, offs_d, sink_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, stride_lb,
                  True, HAS_SINK)
