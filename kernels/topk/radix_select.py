"""Triton top-k by radix select over each row's live prefix: O(live length), CUDA-graph safe.

Why not torch.topk: it sorts a whole fixed-width row, so a buffer sized for 1M context costs the
same at every live length (a 28.7x tax at 4K). Here every pass reads scores[b, :lens[b]] only.

How: scores become order-preserving uint32 keys. Four histogram passes, 8 bits each, find the key
of the k-th largest entry (a pass only counts entries whose higher digits match the pivot found so
far, and a row stops as soon as its pivot bin is taken whole). Each pass is one launch over a
(split, B) grid whose programs stride over the live prefix and add their local histogram into a
per-row global one. A gather launch then writes every entry above the pivot key, plus pivot-key
ties (lowest indices first when only some of them fit). The grid and all buffers depend on B and k
only, never on the score buffer's width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_cluster.kernels.topk.reference import TopkInputError, check_lens_in_range, check_topk_inputs

NUM_BINS = 256
NUM_PASSES = 4


@triton.jit
def _sortable_key(x):
    """float32 -> uint32 whose unsigned order is the float order; -0.0 and +0.0 map alike."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all ones for negatives, the sign bit for positives
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _pivot_state(hist_ptr, b, batch, n, k, PASSES: tl.constexpr):
    """Replay the first PASSES histograms of row b: the pivot prefix found, its bit length, how many
    pivot-key entries are still needed, how many entries carry the pivot prefix, and whether done."""
    bins = tl.arange(0, 256)
    needed = tl.minimum(n, k)
    done = n <= k
    prefix = tl.zeros([], dtype=tl.uint32)
    nbits = tl.zeros([], dtype=tl.int32)
    ties = tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(PASSES):
        h = tl.load(hist_ptr + (p * batch + b) * 256 + bins)
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        pivot = tl.max(tl.where(at_or_above >= needed, bins, -1), axis=0)
        in_pivot = tl.sum(tl.where(bins == pivot, h, 0), axis=0)
        above = tl.sum(tl.where(bins == pivot, at_or_above, 0), axis=0) - in_pivot
        live = not done
        needed = tl.where(live, needed - above, needed)
        prefix = tl.where(live, (prefix << 8) | pivot.to(tl.uint32), prefix)
        nbits = tl.where(live, nbits + 8, nbits)
        ties = tl.where(live, in_pivot, ties)
        done = done | (in_pivot == needed)
    return prefix, nbits, needed, ties, done


@triton.jit
def _radix_hist_kernel(scores_ptr, stride_sb, lens_ptr, hist_ptr, k, width, batch, split,
                       PASS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), width)
    prefix, nbits, needed, ties, done = _pivot_state(hist_ptr, b, batch, n, k, PASS)
    if done:
        return
    acc = tl.zeros([256], dtype=tl.int32)
    for start in range(pid * BLOCK, n, split * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        key = _sortable_key(tl.load(scores_ptr + b * stride_sb + offs, mask=m, other=0.0).to(tl.float32))
        if PASS > 0:
            m = m & ((key >> (32 - 8 * PASS)) == prefix)
        digit = ((key >> (24 - 8 * PASS)) & 255).to(tl.int32)
        acc += tl.histogram(digit, 256, mask=m)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + (PASS * batch + b) * 256 + bins, acc, mask=acc > 0)


@triton.jit
def _radix_gather_kernel(scores_ptr, stride_sb, lens_ptr, hist_ptr, count_ptr, out_ptr, stride_ob,
                         k, width, batch, split, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), width)
    prefix, nbits, needed, ties, done = _pivot_state(hist_ptr, b, batch, n, k, 4)
    take_all = n <= k
    all_ties = take_all | (ties == needed)
    shift = tl.where(take_all, 0, 32 - nbits).to(tl.uint32)
    if pid == 0:
        for j in range(0, k, K_BLOCK):
            slot = j + tl.arange(0, K_BLOCK)
            tl.store(out_ptr + b * stride_ob + slot, tl.full([K_BLOCK], -1, tl.int32), mask=(slot >= n) & (slot < k))
    for start in range(pid * BLOCK, n, split * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        key = _sortable_key(tl.load(scores_ptr + b * stride_sb + offs, mask=m, other=0.0).to(tl.float32))
        top = key >> shift
        sel = m & (take_all | (top > prefix) | (all_ties & (top == prefix)))
        sel_i = sel.to(tl.int32)
        count = tl.sum(sel_i, axis=0)
        if count > 0:
            base = tl.atomic_add(count_ptr + b, count)
            tl.store(out_ptr + b * stride_ob + base + tl.cumsum(sel_i, axis=0) - 1, offs, mask=sel_i > 0)
    if (pid == 0) & (not all_ties):
        # Only some entries with exactly the pivot key fit: the lowest indices win, in index order.
        first = tl.minimum(n, k) - needed
        taken = tl.zeros([], dtype=tl.int32)
        start = tl.zeros([], dtype=tl.int32)
        while (start < n) & (taken < needed):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            key = _sortable_key(tl.load(scores_ptr + b * stride_sb + offs, mask=m, other=0.0).to(tl.float32))
            tie = (m & (key == prefix)).to(tl.int32)
            rank = taken + tl.cumsum(tie, axis=0) - 1
            keep = (tie > 0) & (rank < needed)
            tl.store(out_ptr + b * stride_ob + first + rank, offs, mask=keep)
            taken += tl.sum(tie, axis=0)
            start += BLOCK


def default_split(batch: int, device: torch.device) -> int:
    """Programs per row: about two per multiprocessor over the batch."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, -(-2 * sms // max(batch, 1)))


def topk_triton(
    scores: torch.Tensor,
    lens: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    split: int | None = None,
    block: int = 2048,
    num_warps: int = 8,
) -> torch.Tensor:
    """Indices of the k largest of scores[b, :lens[b]], -1 padded; the set `reference.topk_ref` returns.

    Shapes: scores [B, N] float32, bf16 or fp16 with unit column stride (N may be a graph-capture
    maximum: nothing past lens[b] is read); lens [B] int32/int64 on scores' device; k >= 1.
    Returns int32 [B, k] (`out` if given: int32 [B, k], unit column stride): row b holds the
    min(k, lens[b]) winners in an unspecified order (the set is deterministic: among equal
    scores the lower index wins), then -1. NaN scores are not allowed (their rank is undefined).
    workspace: optional int32 [4*B*256 + B] scratch, zeroed here on every call.
    Under CUDA-graph capture lens values are not checked; the kernels clamp them to [0, N].
    """
    check_topk_inputs(scores, lens, k)
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16) or scores.stride(1) != 1:
        raise TopkInputError(f"topk_triton needs float32/bf16/fp16 scores with unit column stride; got {scores.dtype}")
    batch, width = scores.shape
    if not (scores.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_lens_in_range(lens, width)
    if out is None:
        out = torch.empty((batch, k), dtype=torch.int32, device=scores.device)
    elif tuple(out.shape) != (batch, k) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise TopkInputError(f"out must be int32 [B, k] = [{batch}, {k}] with unit column stride")
    size = NUM_PASSES * batch * NUM_BINS + batch
    if workspace is None:
        workspace = torch.zeros(size, dtype=torch.int32, device=scores.device)
    elif workspace.numel() != size or workspace.dtype != torch.int32 or not workspace.is_contiguous():
        raise TopkInputError(f"workspace must be a contiguous int32 tensor of {size} elements (4*B*256 + B)")
    else:
        workspace.zero_()
    if batch == 0:
        return out
    split = split or default_split(batch, scores.device)
    hist, counts = workspace[: size - batch], workspace[size - batch :]
    grid = (split, batch)
    for p in range(NUM_PASSES):
        _radix_hist_kernel[grid](scores, scores.stride(0), lens, hist, k, width, batch, split,
                                 PASS=p, BLOCK=block, num_warps=num_warps)
    _radix_gather_kernel[grid](scores, scores.stride(0), lens, hist, counts, out, out.stride(0), k, width, batch,
                               split, BLOCK=block, K_BLOCK=min(1024, triton.next_power_of_2(k)), num_warps=num_warps)
    return out
