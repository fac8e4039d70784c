"""`fp8_paged_mqa_logits` with DeepGEMM's signature (as SGLang 0.5.23's `forward_c4_indexer` calls it).

SGLang passes q [rows, 1, 64, 128] float8_e4m3fn, the indexer cache as a byte view [pages, 64, 1, 132]
(per page 64 x 128 e4m3 keys, then 64 float32 scales: exactly `kernels/indexer/fp8_keys`), weights
[rows, 64] float32, context_lens [rows, 1] (or [rows]) int32, block_table [rows, max_pages] int32, a
DeepGEMM schedule (ignored), max_context_len, clean_logits=False. It returns float32 [rows, max_context_len]
logits: logits[r, t] = sum_h relu(q[r, h] . k[t] * scale[t]) * weights[r, h] for t < context_lens[r].

Only each row's live prefix is written; nothing is sized or scanned by max_context_len except the
returned buffer's allocation. On CUDA the one launch of `fused_topk` also selects the row's top-512,
which `topk_transform_paged_v2` picks up when handed these very logits (`fused_topk_for`).

Eager cost (`launch_cache`): per call, the shape-class key of q, the cache, weights, context_lens and
block_table, the logits width max(max_context_len, capacity) (so max_context_len moving below the capacity is
no new key), the stream; then the workspace memset and the one launch. Per key: every check in `_check`.
"""

from __future__ import annotations

import weakref

import torch

from .. import debug
from ..launch_cache import LaunchCache, signature
from ..workspace import scratch
from .errors import fail

INDEX_TOPK = 512  # SGLang's DEFAULT_INDEX_TOPK: the width of the top-k the fused launch computes
_LAST: dict[str, object] = {}  # the latest fused call: weakref to its logits, its top-k buffer


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    fused_kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta,
    max_context_len: int,
    clean_logits: bool,
) -> torch.Tensor:
    """Indexer logits of fp8 keys (see the module docstring); the tail past context_lens[r] is not written."""
    rows = q.shape[0]
    capacity = block_table.shape[1] * fused_kv_cache.shape[1] if block_table.dim() == 2 and fused_kv_cache.dim() == 4 else 0
    width = max(int(max_context_len), capacity)
    tensors = (q, fused_kv_cache, weights, context_lens, block_table)
    key, ptrs = signature(tensors, (width, int(max_context_len) >= 0, clean_logits))
    plan = _PLANS.hit(key, ptrs)
    if plan is not None and plan.steps is not None:
        logits = q.new_empty((rows, width), dtype=torch.float32)
        ptrs.append(logits.data_ptr())
        plan.replay(ptrs, tensors + (logits,))
        returned = logits[:, :max_context_len]
        _LAST.update(logits=weakref.ref(returned), idx=plan.extra["idx"])
        return returned
    if plan is None:
        _check(q, fused_kv_cache, weights, context_lens, block_table, max_context_len, clean_logits)
    logits = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    extra: dict = {}
    with _PLANS.recording(key, ptrs + [logits.data_ptr()], tensors + (logits,), extra, q.is_cuda):
        extra["idx"] = _compute(q, fused_kv_cache, weights, context_lens, block_table, max_context_len, logits)
    returned = logits[:, :max_context_len]
    if q.is_cuda:
        _LAST.update(logits=weakref.ref(returned), idx=extra["idx"])
    return returned


# One launch plan per shape class (`launch_cache`): checks once per key, then the launch and its memset.
_PLANS = LaunchCache("fp8_paged_mqa_logits")


def _compute(q, kv, weights, context_lens, block_table, max_context_len, logits):
    """Scores (and, on CUDA, the fused top-512, whose buffer it returns) of a checked call into `logits`."""
    lens, keys, per_page = _views(q, kv, context_lens)
    rows = q.shape[0]
    if not q.is_cuda:
        from ..indexer.reference import indexer_fp8_ref

        scores = indexer_fp8_ref(q[:, 0].float(), weights, keys, block_table, lens)
        n = min(block_table.shape[1] * per_page, int(max_context_len))
        logits[:, :n] = scores[:, :n]
        return None
    from ..indexer.fused_topk import indexer_topk_triton
    from ..topk.radix_select import workspace_size

    idx = scratch("indexer.topk", rows * INDEX_TOPK, torch.int32, q.device).view(rows, INDEX_TOPK)
    ws = scratch("indexer.topk_ws", workspace_size(rows), torch.int32, q.device)
    indexer_topk_triton(q[:, 0], weights, keys, block_table, lens, INDEX_TOPK, fp8=True, scores=logits, out=idx,
                        workspace=ws, check_values=debug.value_checks())
    return idx


def fused_topk_for(scores: torch.Tensor, k: int) -> torch.Tensor | None:
    """The top-k positions [rows, k] the latest fused call computed, if `scores` is the very tensor it
    returned (same object: a new tensor at the same address does not match) and k is its width."""
    ref = _LAST.get("logits")
    if ref is None or ref() is not scores or k != INDEX_TOPK:
        return None
    return _LAST["idx"]


def _check(q, kv, weights, context_lens, block_table, max_context_len, clean_logits):
    if clean_logits:
        fail("clean_logits=True would fill every row up to max_context_len with -inf "
             "(O(max context)); SGLang passes False, and only that is supported")
    if not (q.dim() == 4 and q.shape[1] == 1):
        fail(f"q must be [rows, 1, heads, dim] (next_n = 1); got {list(q.shape)}")
    if not (q.dtype == torch.float8_e4m3fn or not q.is_cuda):
        fail(f"q must be float8_e4m3fn (SGLang's fp8 indexer); got {q.dtype}")
    rows, _, heads, dim = q.shape
    if not (kv.dim() == 4 and kv.shape[2] == 1 and kv.shape[3] == dim + 4 and kv.dtype == torch.uint8):
        fail(f"fused_kv_cache must be uint8 [pages, page_size, 1, {dim + 4}]; got {kv.dtype} {list(kv.shape)}")
    per_page = kv.shape[1]
    if not (kv.stride(0) == per_page * (dim + 4) and kv.stride(3) == 1):
        fail(f"fused_kv_cache pages must be packed ({per_page * (dim + 4)} B apart); got strides {kv.stride()}")
    if not (weights.shape == (rows, heads) and weights.dtype == torch.float32):
        fail(f"weights must be float32 [{rows}, {heads}]; got {weights.dtype} {list(weights.shape)}")
    if context_lens.dim() == 2:
        if context_lens.shape[1] != 1:
            fail(f"context_lens must be [rows] or [rows, 1]; got {list(context_lens.shape)}")
        context_lens = context_lens[:, 0]
    if not (context_lens.shape == (rows,) and context_lens.dtype == torch.int32 and context_lens.stride(0) == 1):
        fail(f"context_lens must be contiguous int32 [{rows}] (or [{rows}, 1]); got {context_lens.dtype} "
             f"{list(context_lens.shape)}")
    if not (block_table.dim() == 2 and block_table.shape[0] == rows and block_table.dtype == torch.int32):
        fail(f"block_table must be int32 [{rows}, max_pages]; got {block_table.dtype} {list(block_table.shape)}")
    if not (int(max_context_len) >= 0):
        fail(f"max_context_len must be >= 0; got {max_context_len}")


def _views(q, kv, context_lens):
    """(lens [rows], keys [pages, page bytes], tokens per page) of a checked call."""
    dim = q.shape[3]
    pages, per_page = kv.shape[0], kv.shape[1]
    if context_lens.dim() == 2:
        context_lens = context_lens[:, 0]
    keys = torch.as_strided(kv, (pages, per_page * (dim + 4)), (kv.stride(0), 1))
    return context_lens, keys, per_page
