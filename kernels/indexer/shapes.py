"""Input checks shared by the indexer reference and kernels, so both refuse bad input the same way.

Shapes are checked on every call (free: no device sync). Values (lens within the page table) need a
device-to-host read, so `check_lens_values` is separate and callers skip it under CUDA-graph capture.
"""

from __future__ import annotations

import torch


class IndexerInputError(ValueError):
    """An indexer input has the wrong shape, dtype or device; the message says which and how to fix it."""


def check_indexer_inputs(q, weights, k_cache, page_table, lens, *, key_kind: str) -> int:
    """Validate shapes/dtypes/devices; return E, the entries per page. key_kind is 'float' or 'fp8'."""
    if q.dim() != 3 or not q.is_floating_point():
        raise IndexerInputError(f"q must be a float tensor [B, Hi, Di]; got {tuple(q.shape)} {q.dtype}")
    batch, heads, dim = q.shape
    if tuple(weights.shape) != (batch, heads) or not weights.is_floating_point():
        raise IndexerInputError(
            f"weights must be a float tensor [B, Hi] = [{batch}, {heads}]; got {tuple(weights.shape)} {weights.dtype}"
        )
    if key_kind == "float":
        if k_cache.dim() != 3 or k_cache.shape[2] != dim or not k_cache.is_floating_point():
            raise IndexerInputError(
                f"k_cache must be a float tensor [P, E, Di] with Di = {dim}; got {tuple(k_cache.shape)} {k_cache.dtype}"
            )
        per_page = k_cache.shape[1]
    elif key_kind == "fp8":
        if k_cache.dim() != 2 or k_cache.dtype != torch.uint8 or k_cache.shape[1] % (dim + 4):
            raise IndexerInputError(
                f"k_cache_fp8 must be uint8 [P, E*(Di+4)] with Di = {dim} (see fp8_keys.quantize_keys); "
                f"got {tuple(k_cache.shape)} {k_cache.dtype}"
            )
        per_page = k_cache.shape[1] // (dim + 4)
    else:
        raise IndexerInputError(f"key_kind must be 'float' or 'fp8'; got {key_kind!r}")
    if per_page < 1:
        raise IndexerInputError("k_cache must hold at least one entry per page")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype not in (torch.int32, torch.int64):
        raise IndexerInputError(
            f"page_table must be int32 [B, max_pages] with B = {batch}; got {tuple(page_table.shape)} {page_table.dtype}"
        )
    if tuple(lens.shape) != (batch,) or lens.dtype not in (torch.int32, torch.int64):
        raise IndexerInputError(f"lens must be int32 [B] with B = {batch}; got {tuple(lens.shape)} {lens.dtype}")
    devices = {t.device for t in (q, weights, k_cache, page_table, lens)}
    if len(devices) != 1:
        raise IndexerInputError(f"all indexer inputs must be on one device; got {sorted(map(str, devices))}")
    return per_page


def check_lens_values(lens: torch.Tensor, page_table: torch.Tensor, per_page: int, num_pages: int) -> None:
    """lens in [0, max_pages*E] and the live pages' ids in [0, P). Reads device memory (syncs)."""
    capacity = page_table.shape[1] * per_page
    if lens.numel() == 0:
        return
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0 or hi > capacity:
        raise IndexerInputError(
            f"lens must lie in [0, max_pages*E] = [0, {capacity}]; got values in [{lo}, {hi}]: "
            "grow page_table or shorten the request"
        )
    live_pages = (lens.long() + per_page - 1) // per_page
    cols = torch.arange(page_table.shape[1], device=page_table.device)
    live = page_table[cols[None, :] < live_pages[:, None]]
    if live.numel() and (int(live.min()) < 0 or int(live.max()) >= num_pages):
        raise IndexerInputError(
            f"page_table holds physical page ids outside [0, {num_pages}) for live pages; "
            "every live logical page must map to a page of k_cache"
        )
