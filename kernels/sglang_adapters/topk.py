"""`topk_transform_paged_v2` with the signature of SGLang 0.5.23's (`kernels/ops/attention/dsv4/topk.py`).

Each row selects the top-k of scores[r, :seq_lens[r]] (k = out_page_indices.shape[1]; all live entries
when there are fewer) and writes their pool slots through the page table, -1 past the selected count;
out_raw_indices (optional) receives the positions themselves. The order within a row is unspecified
(SGLang's consumers read the row as a set). When `scores` are the logits `fp8_paged_mqa_logits` just
returned, its fused launch already selected them, and only the page-table map runs here.

Eager cost (`launch_cache`): per call, the shape-class key of scores (fused: its rows only, with the fused
top-k buffer in its place), seq_lens, page_tables, the outputs, page_size and the stream; then the launches.
Per key: every check in `_check`.
"""

from __future__ import annotations

import torch

from .. import debug
from ..launch_cache import LaunchCache, signature
from ..workspace import scratch
from .errors import fail
from .indexer import fused_topk_for


def topk_transform_paged_v2(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor | None,
    out_page_indices: torch.Tensor,
    page_size: int,
    metadata: torch.Tensor,
    out_raw_indices: torch.Tensor | None = None,
) -> None:
    """Writes out_page_indices (and out_raw_indices); `metadata` (SGLang's top-k plan) is not needed."""
    k = out_page_indices.shape[1] if out_page_indices.dim() == 2 else 0
    fused = fused_topk_for(scores, k) if scores.is_cuda else None
    # Fused: the scores were ours and only their row count matters (the top-k is already in `fused`); the
    # logits width, which moves with max_context_len every few steps, is then no part of the key.
    head = (scores.shape[0], scores.dtype, scores.stride(-1)) if fused is not None else None
    tensors = (scores if fused is None else fused, seq_lens, page_tables, out_page_indices, out_raw_indices)
    key, ptrs = signature(tensors, (page_size, head))
    plan = _PLANS.hit(key, ptrs)
    if plan is not None and plan.steps is not None:
        plan.replay(ptrs, tensors)
        return
    if plan is None:
        _check(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)
    with _PLANS.recording(key, ptrs, tensors, {}, scores.is_cuda):
        _compute(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices, fused)


# One launch plan per shape class (`launch_cache`): checks once per key, then the launches.
_PLANS = LaunchCache("topk_transform_paged_v2")


def _compute(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices, idx) -> None:
    """The checked call; idx: the fused indexer's top-k for these scores (None: select here)."""
    rows, k = out_page_indices.shape
    shift = page_size.bit_length() - 1
    if not scores.is_cuda:
        from ..topk.page_transform import page_transform_ref
        from ..topk.reference import topk_ref

        idx = topk_ref(scores, seq_lens, k)
        out_page_indices.copy_(page_transform_ref(idx, page_tables, shift))
        if out_raw_indices is not None:
            out_raw_indices.copy_(idx)
        return
    from ..topk.page_transform import page_transform
    from ..topk.radix_select import topk_triton, workspace_size

    if idx is None:
        idx = scratch("topk.idx", rows * k, torch.int32, scores.device).view(rows, k)
        ws = scratch("topk.ws", workspace_size(rows), torch.int32, scores.device)
        topk_triton(scores, seq_lens, k, out=idx, workspace=ws, check_values=debug.value_checks())
    page_transform(idx, page_tables, shift, out_page_indices, out_raw_indices)


def _check(scores, seq_lens, page_tables, out, page_size, raw) -> None:
    if not (scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(1) == 1):
        fail(f"scores must be float32 [rows, width] with unit column stride; got {scores.dtype} {list(scores.shape)}")
    rows = scores.shape[0]
    if not (seq_lens.shape == (rows,) and seq_lens.dtype == torch.int32):
        fail(f"seq_lens must be int32 [{rows}]; got {seq_lens.dtype} {list(seq_lens.shape)}")
    if not (out.dim() == 2 and out.shape[0] == rows and out.dtype == torch.int32 and out.stride(1) == 1):
        fail(f"out_page_indices must be int32 [{rows}, k] with unit column stride; got {out.dtype} {list(out.shape)}")
    if not (isinstance(page_size, int) and page_size >= 1 and page_size & (page_size - 1) == 0):
        fail(f"page_size must be a power of two; got {page_size!r}")
    if page_tables is not None:
        if not (page_tables.dim() == 2 and page_tables.shape[0] == rows and page_tables.dtype == torch.int32
                and page_tables.stride(1) == 1):
            fail(f"page_tables must be int32 [{rows}, pages]; got {page_tables.dtype} {list(page_tables.shape)}")
    if raw is not None:
        if not (raw.shape == out.shape and raw.dtype == torch.int32 and raw.stride(1) == 1):
            fail(f"out_raw_indices must be int32 {list(out.shape)}; got {raw.dtype} {list(raw.shape)}")
    for name, t in (("seq_lens", seq_lens), ("page_tables", page_tables), ("out_page_indices", out),
                    ("out_raw_indices", raw)):
        if not (t is None or t.device == scores.device):
            fail(f"{name} is on {getattr(t, 'device', None)}, "
                 f"scores on {scores.device}")
