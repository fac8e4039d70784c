"""Exact semantics of DeepSeek-V4 sparse MLA decode, in plain PyTorch.

This is the oracle the Triton kernel is tested against and the path the embedded engine runs on
CPU (any float dtype, any H and D). Each query attends its own sparse set of KV rows: up to W
sliding-window rows of the main cache plus up to K selected compressed entries of an extra cache.
There is one KV head and V = K (all D dims). Math is done in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from typing import Any

import torch

from . import checks
from .fp8_layout import check_cache, dequantize_kv_v4, gather_slots


def _gather(rows: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    valid = idx >= 0
    if lens is not None:
        pos = torch.arange(idx.shape[1], device=idx.device)
        valid = valid & (pos[None, :] < lens[:, None].long())
    picked = rows[idx.clamp_min(0).long()]  # [B, n, D]
    return picked, valid


def sparse_mla_decode_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    window_idx: torch.Tensor,
    extra_kv: torch.Tensor | None = None,
    extra_idx: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    scale: float | None = None,
    window_lens: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode attention (reference).

    q:           [B, H, D] float (any float dtype; the output has this dtype)
    kv:          [N, D] main-cache rows (K = V), any float dtype
    window_idx:  [B, W] int32, row of `kv` per window position, -1 = invalid
    extra_kv:    [M, D] extra-cache rows (compressed entries) or None
    extra_idx:   [B, K] int32, row of `extra_kv`, -1 = invalid; None iff extra_kv is None
    sink:        [H] float32 per-head attention sink, or None
    scale:       softmax scale, default D ** -0.5
    window_lens: [B] int32 or None; window positions >= len are ignored (same for extra_lens)
    Returns out [B, H, D] in q.dtype and lse [B, H] float32: the natural log-sum-exp of the scaled
    scores over valid rows (sink excluded). A query with no valid row gets out 0 and lse -inf.
    With a sink: out *= exp(lse) / (exp(lse) + exp(sink[h])).
    """
    b, h, d = checks.check_queries(q)
    n = checks.check_rows(kv, d, "kv", q.device)
    checks.check_indices(window_idx, b, "window_idx", q.device)
    checks.check_index_values(window_idx, n, "window_idx")
    checks.check_lens(window_lens, b, "window_lens", q.device)
    checks.check_extra_pair(extra_kv, extra_idx)
    checks.check_sink(sink, h, q.device)
    scale = d**-0.5 if scale is None else float(scale)

    if extra_kv is not None:
        m = checks.check_rows(extra_kv, d, "extra_kv", q.device)
        checks.check_indices(extra_idx, b, "extra_idx", q.device)
        checks.check_index_values(extra_idx, m, "extra_idx")
        checks.check_lens(extra_lens, b, "extra_lens", q.device)
    elif extra_lens is not None:
        raise checks.SparseDecodeInputError("extra_lens was given without extra_kv/extra_idx")
    rows, valid = gather_rows(kv, window_idx, extra_kv, extra_idx, window_lens, extra_lens)
    return attend(q, rows, valid, sink, scale)


def attend(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention itself on gathered rows: q [B, H, D], rows [B, R, D], valid [B, R] bool."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = rows.to(compute)
    scores = torch.einsum("bhd,brd->bhr", q.to(compute), rows) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where no row is valid
    has_any = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(has_any, lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("bhr,brd->bhd", probs, rows)
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.to(compute)[None, :])[..., None]
    return out.to(q.dtype), lse.float()


def gather_rows(kv: torch.Tensor, window_idx: torch.Tensor, extra_kv: torch.Tensor | None = None,
                extra_idx: torch.Tensor | None = None, window_lens: torch.Tensor | None = None,
                extra_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected rows [B, W + K, D] (window then extra, in kv's dtype) and their validity [B, W + K]."""
    rows, valid = _gather(kv, window_idx, window_lens)
    if extra_kv is not None:
        extra_rows, extra_valid = _gather(extra_kv, extra_idx, extra_lens)
        rows = torch.cat([rows, extra_rows.to(rows.dtype)], dim=1)
        valid = torch.cat([valid, extra_valid], dim=1)
    return rows, valid


def sparse_mla_decode_fp8_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    window_idx: torch.Tensor,
    extra_cache: torch.Tensor | None = None,
    extra_idx: torch.Tensor | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for the V4 fp8 layout: dequantise the caches (exactly), then `sparse_mla_decode_ref`.

    kv_cache / extra_cache: uint8 [pages, 37440] (see fp8_layout); indices are slots page * 64 + offset.
    options (sink, scale, window_lens, extra_lens), the other arguments and both outputs are as in
    `sparse_mla_decode_ref`, with D = 512.
    """
    check_cache(kv_cache, "kv_cache")
    kv = dequantize_kv_v4(kv_cache)
    extra = None
    if extra_cache is not None:
        check_cache(extra_cache, "extra_cache")
        extra = dequantize_kv_v4(extra_cache)
    return sparse_mla_decode_ref(q, kv, window_idx, extra, extra_idx, **options)


def sparse_mla_decode_paged_ref(q: torch.Tensor, window: tuple, extra: tuple | None = None,
                                sink: torch.Tensor | None = None,
                                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `launch.sparse_decode_paged`: V4 fp8 caches of any page geometry.

    window / extra: (cache uint8 [P, page_stride], PageGeometry, indices int32 [B, n] (slots, -1 invalid),
    lens int32 [B] or None). Only the selected slots are dequantised (exactly, as `gather_slots` reads them),
    so the cost follows the rows read, not the caches' size (each distinct slot once: prefill rows share their
    windows); then `attend` as `sparse_mla_decode_ref`.
    """
    b, h, d = checks.check_queries(q)
    rows, valid = [], []
    for cache, geometry, idx, lens in (window,) if extra is None else (window, extra):
        checks.check_indices(idx, b, "window_idx" if not rows else "extra_idx", q.device)
        checks.check_lens(lens, b, "window_lens" if not rows else "extra_lens", q.device)
        ok = idx >= 0
        if lens is not None:
            ok = ok & (torch.arange(idx.shape[1], device=idx.device)[None, :] < lens[:, None].long())
        slots, where = torch.unique(torch.where(ok, idx, 0), return_inverse=True)   # each slot decoded once, none
        # past the lens (a CUDA graph's lists hold stale indices there)
        rows.append(gather_slots(cache, geometry, slots)[where])
        valid.append(ok)
    checks.check_sink(sink, h, q.device)
    return attend(q, torch.cat(rows, dim=1), torch.cat(valid, dim=1), sink, d**-0.5 if scale is None else float(scale))
