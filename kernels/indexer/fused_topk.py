"""Indexer and top-k in one launch: the scores' first radix pass comes free with scoring.

Why fuse: on the H200 at B = 32 the separate top-k launch, its workspace memset and its first
histogram pass over the scores cost more than the selection work itself at short lengths. Here the
(split, B) programs that score a request's live entries also histogram the top 8 bits of the
scores they produce, meet at the row's barrier (which also publishes the scores they stored), and
go on with the remaining radix passes and the gather of `radix_passes` over the row's live
prefix, which is L2-resident by then. One launch, still O(live length) and CUDA-graph safe: the
grid is (split, B) with split capped so that all programs are resident at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_cluster.kernels.fast_launch import launch as fast_launch
from dsv4_cluster.kernels.indexer.shapes import IndexerInputError, check_indexer_inputs, check_lens_values
from dsv4_cluster.kernels.indexer.triton_indexer import default_split, fp8_pages_ok, load_query, score_block
from dsv4_cluster.kernels.topk.radix_passes import (
    gather,
    select_passes,
    sortable_key,
)
from dsv4_cluster.kernels.topk.radix_select import capped_split, workspace_size


@triton.jit
def _indexer_topk_kernel(
    q_ptr, w_ptr, k_ptr, scale_ptr, pt_ptr, lens_ptr, scores_ptr, out_ptr, hist_ptr, bar_ptr, count_ptr,
    stride_qb, stride_qh, stride_wb, stride_kp, stride_ke, stride_sp, stride_ptb, stride_sb, stride_ob,
    heads, dim, capacity, split, k, batch,
    PER_PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, MASK_D: tl.constexpr, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
    Q_FP8_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), capacity)
    row_ptr = scores_ptr + b.to(tl.int64) * stride_sb
    q_t, w = load_query(q_ptr, w_ptr, b, stride_qb, stride_qh, stride_wb, heads, dim, BLOCK_H, BLOCK_D, Q_FP8_DOT)
    acc = tl.zeros([256], dtype=tl.int32)
    for start in range(pid * BLOCK_T, n, split * BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        score = score_block(q_t, w, k_ptr, scale_ptr, pt_ptr + b * stride_ptb, t, n, stride_kp, stride_ke,
                            stride_sp, dim, PER_PAGE, BLOCK_D, FP8, IEEE, MASK_D)
        tl.store(row_ptr + t, score, mask=t < n)
        acc += tl.histogram((sortable_key(score) >> 24).to(tl.int32), 256, mask=t < n)
    needed, prefix, nbits, ties, done = select_passes(row_ptr, n, k, pid, split, hist_ptr, bar_ptr, b, batch, acc,
                                                      True, BLOCK)
    gather(row_ptr, out_ptr + b * stride_ob, count_ptr + b, n, k, pid, split, needed, prefix, nbits, ties,
           BLOCK, K_BLOCK)


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    k: int,
    *,
    fp8: bool = False,
    scores: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    split: int | None = None,
    block_t: int = 128,
    block: int = 2048,
    num_warps: int = 4,
    num_stages: int = 3,
    check_values: bool = True,
    fp8_dot: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k indices of the indexer scores and the scores, in one launch.

    Inputs as `triton_indexer.indexer_triton` (fp8=False: k_cache [P, E, Di] of q's dtype) or
    `indexer_fp8_triton` (fp8=True: k_cache uint8 [P, E*(Di+4)]); k >= 1.
    Returns (idx int32 [B, k], scores float32 [B, max_pages*E]), as `radix_select.topk_triton` of
    `indexer_triton`'s scores: idx row b holds the min(k, lens[b]) winners in an unspecified order
    (among equal scores the lower index wins), then -1; scores past lens[b] are not written.
    scores / out / workspace (int32, `radix_select.workspace_size(B)` elements, zeroed here) may be
    passed preallocated; scores may be wider than max_pages*E (only the live prefix is written).
    check_values=False skips the lens / page-table value checks (they read device memory: a sync).
    fp8_dot: with e4m3 q and fp8 keys, score with fp8 tensor-core products (no key conversion); False widens
    both to bf16 first (the same exact products). Programs of one request wait for each other, so on CUDA split is lowered to
    what the GPU holds resident at once, and the Triton interpreter needs split == 1.
    """
    per_page = check_indexer_inputs(q, weights, k_cache, page_table, lens, key_kind="fp8" if fp8 else "float")
    batch, heads, dim = q.shape
    if not fp8 and k_cache.dtype != q.dtype:
        raise IndexerInputError(f"k_cache dtype {k_cache.dtype} must equal q's {q.dtype}; cast one of them")
    if fp8 and (dim % 4 or not fp8_pages_ok(k_cache)):
        raise IndexerInputError(f"fp8 keys need Di % 4 == 0 (got {dim}) and k_cache pages of contiguous bytes 16-B "
                                f"apart (got strides {k_cache.stride()})")
    if heads > 256 or dim > 256 or q.stride(2) != 1 or weights.stride(1) != 1:
        raise IndexerInputError("need Hi, Di <= 256 and q, weights contiguous along their last dim")
    if not isinstance(k, int) or k < 1:
        raise IndexerInputError(f"k must be a positive int; got {k!r}")
    capacity = page_table.shape[1] * per_page
    if check_values and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_lens_values(lens, page_table, per_page, k_cache.shape[0])
    if scores is not None and scores.dim() == 2 and scores.shape[1] > capacity:
        scores = _buffer(scores, (batch, scores.shape[1]), torch.float32, q.device, "scores")
    else:
        scores = _buffer(scores, (batch, capacity), torch.float32, q.device, "scores")
    out = _buffer(out, (batch, k), torch.int32, q.device, "out")
    if workspace is None:
        workspace = torch.zeros(workspace_size(batch), dtype=torch.int32, device=q.device)
    elif workspace.numel() != workspace_size(batch) or workspace.dtype != torch.int32 or not workspace.is_contiguous():
        raise IndexerInputError(f"workspace must be contiguous int32 with workspace_size(B) = {workspace_size(batch)}")
    else:
        workspace.zero_()
    if split is None:
        split = default_split(batch, q.device) if q.is_cuda else 1
    elif not q.is_cuda and split != 1:
        raise IndexerInputError("the Triton interpreter runs programs one by one; the per-row barrier needs split=1")
    if batch == 0:
        return out, scores
    hist_end = 4 * batch * 256
    if fp8:
        scale_view = k_cache.view(torch.float32)
        keys, scales, strides = k_cache, scale_view[:, per_page * dim // 4 :], (k_cache.stride(0), dim, scale_view.stride(0))
    else:
        keys, scales, strides = k_cache, k_cache, (k_cache.stride(0), k_cache.stride(1), 0)
        if k_cache.stride(2) != 1:
            raise IndexerInputError("k_cache must be contiguous along Di; call .contiguous() first")
    block_d = max(16, triton.next_power_of_2(dim))
    args = (q, weights, keys, scales, page_table, lens, scores, out,
            workspace[:hist_end], workspace[hist_end : hist_end + 4 * batch], workspace[hist_end + 4 * batch :],
            q.stride(0), q.stride(1), weights.stride(0), *strides, page_table.stride(0), scores.stride(0),
            out.stride(0), heads, dim, capacity)
    kwargs = dict(PER_PAGE=per_page, BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=block_d,
                  BLOCK_T=block_t, FP8=fp8, IEEE=q.dtype == torch.float32, MASK_D=block_d != dim, BLOCK=block,
                  K_BLOCK=min(1024, triton.next_power_of_2(k)), num_warps=num_warps, num_stages=num_stages,
                  Q_FP8_DOT=fp8 and fp8_dot and q.dtype == torch.float8_e4m3fn)
    if q.is_cuda:
        split = capped_split(_indexer_topk_kernel, args + (split, k, batch), kwargs, batch, split, q.device)
    fast_launch(_indexer_topk_kernel, (split, batch), args + (split, k, batch), kwargs)
    return out, scores


def _buffer(given, shape, dtype, device, name):
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(given.shape) != shape or given.dtype != dtype or given.stride(1) != 1:
        raise IndexerInputError(f"{name} must be {dtype} {list(shape)} with unit column stride")
    return given
