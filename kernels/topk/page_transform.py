"""Selected positions -> pool slots through a page table (SGLang's `topk_transform_paged` output).

A request's position t lives in logical page t >> s (pages of 2**s entries), at offset t & (2**s - 1);
its pool slot is page_table[b, t >> s] * 2**s + offset. -1 stays -1. One program per row, O(k) work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _page_transform_kernel(idx_ptr, stride_ib, pt_ptr, stride_pb, out_ptr, stride_ob, raw_ptr, stride_rb, k,
                           PAGE_SHIFT: tl.constexpr, K_BLOCK: tl.constexpr, HAS_PT: tl.constexpr,
                           HAS_RAW: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_BLOCK)
    m = j < k
    i = tl.load(idx_ptr + b * stride_ib + j, mask=m, other=-1)
    if HAS_PT:
        valid = i >= 0
        page = tl.load(pt_ptr + b * stride_pb + (i >> PAGE_SHIFT), mask=m & valid, other=0)
        slot = tl.where(valid, (page << PAGE_SHIFT) + (i & ((1 << PAGE_SHIFT) - 1)), -1)
    else:
        slot = i
    tl.store(out_ptr + b * stride_ob + j, slot, mask=m)
    if HAS_RAW:
        tl.store(raw_ptr + b * stride_rb + j, i, mask=m)


def page_transform(idx: torch.Tensor, page_table: torch.Tensor | None, page_shift: int, out: torch.Tensor,
                   raw_out: torch.Tensor | None = None) -> None:
    """out[b, j] = slot of position idx[b, j] (-1 stays -1); raw_out (optional) = idx. All int32 [B, k]
    with unit column stride; page_table int32 [B, pages] or None (out = idx). Triton (CUDA, or CPU under
    TRITON_INTERPRET=1); no checks here: the caller checked shapes."""
    rows, k = idx.shape
    if rows == 0:
        return
    _page_transform_kernel[(rows,)](
        idx, idx.stride(0), page_table if page_table is not None else idx,
        page_table.stride(0) if page_table is not None else 0, out, out.stride(0),
        raw_out if raw_out is not None else out, raw_out.stride(0) if raw_out is not None else 0, k,
        PAGE_SHIFT=page_shift, K_BLOCK=triton.next_power_of_2(k), HAS_PT=page_table is not None,
        HAS_RAW=raw_out is not None, num_warps=4)


def page_transform_ref(idx: torch.Tensor, page_table: torch.Tensor | None, page_shift: int) -> torch.Tensor:
    """The same map in PyTorch: int32 [B, k] slots."""
    if page_table is None:
        return idx.clone()
    valid = idx >= 0
    safe = idx.clamp_min(0).long()
    pages = torch.gather(page_table.long(), 1, safe >> page_shift)
    slots = (pages << page_shift) + (safe & ((1 << page_shift) - 1))
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
