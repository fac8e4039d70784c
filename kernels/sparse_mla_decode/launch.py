"""Host side of the sparse MLA decode: argument checks, outputs and workspace, the launches.

What a call launches (class, backend, block, stages, head groups, splits, constexprs) is resolved once, from its
shapes, by `plan.plan_launch` (the dispatch table's row); this module only launches it.

Everything here depends on tensor shapes only (never on index or length values), so a call is
CUDA-graph capturable: the split count, the grid and the workspace size are fixed for fixed shapes,
and index values are not checked (an index must be -1 or a row of its cache, as in FlashMLA).
On CPU tensors the same kernels run under TRITON_INTERPRET=1 (the tests do this).
"""

from __future__ import annotations

import torch

from . import checks
from .fp8_layout import DEFAULT_GEOMETRY, check_cache
from ..fast_launch import launch as fast_launch
from ..workspace import scratch
from . import kernel as _kernels
from .config import DIM, LaunchConfig, _num_sms
from .config import gluon_api_unavailable, gluon_unavailable, resolved  # noqa: F401  (tests and benches read them here)
from .plan import LaunchPlan, MergePlan, plan_launch

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DEFAULT_CONFIG = LaunchConfig()


def _check_common(q, window_idx, extra_idx, sink, window_lens, extra_lens, has_extra):
    b, h, d = checks.check_queries(q)
    if d != DIM:
        raise checks.SparseDecodeInputError(f"the Triton kernel needs D={DIM} (DeepSeek-V4); got D={d}: use the reference")
    if h < 16 or h > 64 or h & (h - 1):
        raise checks.SparseDecodeInputError(f"the Triton kernel needs H in {{16, 32, 64}}; got H={h}: use the reference")
    if q.dtype not in TRITON_DTYPES:
        raise checks.SparseDecodeInputError(f"q must be bf16, fp16 or fp32 for the Triton kernel, got {q.dtype}")
    if q.stride(2) != 1:
        raise checks.SparseDecodeInputError("q's last dim must be contiguous; call .contiguous() on it")
    w = checks.check_indices(window_idx, b, "window_idx", q.device)
    checks.check_lens(window_lens, b, "window_lens", q.device)
    k = 0
    if has_extra:
        k = checks.check_indices(extra_idx, b, "extra_idx", q.device)
        checks.check_lens(extra_lens, b, "extra_lens", q.device)
    elif extra_lens is not None:
        raise checks.SparseDecodeInputError("extra_lens was given without an extra cache and extra_idx")
    for name, t in (("window_idx", window_idx), ("extra_idx", extra_idx)):
        if t is not None and t.stride(1) != 1:
            raise checks.SparseDecodeInputError(f"{name}'s last dim must be contiguous; call .contiguous() on it")
    checks.check_sink(sink, h, q.device)
    return b, h, w, k


def _outputs(q, splits, out=None, lse=None):
    """out, lse (given or new), and the per-split partial (out, lse) workspace, cached per device and
    stream (`workspace.scratch`; aliases of lse when there is one split: the kernel then writes the final
    result directly and never touches them)."""
    b, h, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device) if lse is None else lse
    if splits == 1:
        return out, lse, lse, lse
    part_o = scratch("sparse_decode.part_o", b * splits * h * DIM, torch.float32, q.device)
    part_lse = scratch("sparse_decode.part_lse", b * splits * h, torch.float32, q.device)
    return out, lse, part_o, part_lse


def _kernel_args(q, main, main_stride, extra, extra_stride, window_idx, extra_idx, sink, scale,
                 window_lens, extra_lens, w, k, out, lse, part_o, part_lse, splits, counters=None):
    """The positional arguments both sparse-decode kernels (Triton and Gluon) take, in order; absent
    optional tensors are replaced by a tensor the kernel will not read (its HAS_* flag is off).
    `counters`: the Gluon kernel's split-merge counters (it alone takes them)."""
    has_extra = extra is not None
    scale = DIM**-0.5 if scale is None else float(scale)
    return (
        q, q.stride(0), q.stride(1),
        main, main_stride, extra if has_extra else main, extra_stride if has_extra else main_stride,
        window_idx, window_idx.stride(0), w,
        extra_idx if has_extra else window_idx, extra_idx.stride(0) if has_extra else 0, k,
        window_lens if window_lens is not None else window_idx,
        extra_lens if extra_lens is not None else window_idx,
        sink if sink is not None else lse,
        out, out.stride(0), out.stride(1), lse, lse.stride(0),
        part_o, part_lse, *(() if counters is None else (counters,)),
        scale * _kernels.LOG2E, splits,
    )


def _launch(q, main, main_stride, extra, extra_stride, window_idx, extra_idx, sink, scale,
            window_lens, extra_lens, w, k, is_fp8, config, geos=(DEFAULT_GEOMETRY, DEFAULT_GEOMETRY),
            out=None, lse=None):
    """Launch what `plan.plan_launch` resolved for this call's shapes, then the split merge if the kernel left it."""
    b, h, _ = q.shape
    flags = (extra is not None, window_lens is not None, extra is not None and extra_lens is not None,
             sink is not None)
    p = plan_launch(q.device, b, h, q.dtype, is_fp8, config or _DEFAULT_CONFIG, w, k, flags, geos,
                    _num_sms(q.device))
    out, lse, part_o, part_lse = _outputs(q, p.splits, out, lse)
    counters = None  # the Gluon kernels' split counters; lse stands in (unread) where they do not merge
    if p.backend in ("gluon", "gluon_h16"):
        counters = split_counters(q.device, b) if p.fused_merge else lse
    if p.backend == "triton" and not q.is_cuda and type(_kernels._sparse_decode_kernel).__name__ != "InterpretedFunction":
        raise checks.SparseDecodeInputError(
            "the Triton kernel runs on CPU tensors only under TRITON_INTERPRET=1 (set before import); "
            "on CPU call sparse_mla_decode_ref, or sparse_mla_decode, which picks it"
        )
    fast_launch(_kernel(p), p.grid,
                _kernel_args(q, main, main_stride, extra, extra_stride, window_idx, extra_idx, sink, scale,
                             window_lens, extra_lens, w, k, out, lse, part_o, part_lse, p.splits, counters),
                p.kwargs, max_shared=p.max_shared)
    if p.merge is not None:
        _combine(part_o, part_lse, sink, out, lse, p.splits, p.merge)
    return out, lse


def _kernel(p: LaunchPlan):
    """The kernel function the plan names (a Gluon module is imported when its kernel first runs)."""
    if p.backend == "gluon":
        from . import gluon_kernel

        return gluon_kernel._sparse_decode_ws_kernel
    if p.backend == "gluon_h16":
        from . import gluon_h16

        return gluon_h16._sparse_decode_h16_kernel
    if p.backend == "gluon_mma_v2":
        from . import gluon_mma_v2, gluon_mma_v2_pair

        return gluon_mma_v2_pair._sparse_decode_mma_v2_pair_kernel if p.pairs else \
            gluon_mma_v2._sparse_decode_mma_v2_kernel
    return _kernels._sparse_decode_kernel


COUNTER_STRIDE = 32  # int32s per query: its two counters alone in a 128-byte line (gluon_epilogue.COUNTER_STRIDE)
# Per device: per query, the 64-head kernel's two u32 counters (arrivals, departures) for its split barrier, or
# the 16-head kernel's one arrivals counter (the last split to arrive merges; nobody waits). They
# start at zero and every launch leaves them at zero, so one buffer serves every call on the device that
# runs in stream order (decode runs its layers one after another on one stream). Two fused-merge launches
# running at the same time on one device (two streams) would share them: do not do that.
_SPLIT_COUNTERS: dict[int | None, torch.Tensor] = {}


def split_counters(device: torch.device, batch: int) -> torch.Tensor:
    """The fused merge's counters for `batch` queries on `device`: allocated (zeroed) at the first eager call;
    under CUDA-graph capture without one, a fresh zeroed buffer whose memset is captured with the kernel.
    Every fused-merge launch on the device shares them, so two such launches must not run at the same time
    (other streams, graphs replayed side by side): give those `LaunchConfig(fused_merge=False)`. In the 64-head
    kernel, counters that cannot complete make it trap after gluon_epilogue.SPIN_LIMIT_NS (a CUDA error) instead
    of hanging; the 16-head kernel never waits on them."""
    cuda = device.type == "cuda"
    index = device.index if device.index is not None or not cuda else torch.cuda.current_device()
    buf = _SPLIT_COUNTERS.get(index)
    if buf is None or buf.numel() < COUNTER_STRIDE * batch:
        fresh = torch.zeros(COUNTER_STRIDE * max(batch, 1024), dtype=torch.int32, device=device)
        if cuda and torch.cuda.is_current_stream_capturing():
            return fresh  # not kept: its memory and its zeroing belong to this graph
        buf = _SPLIT_COUNTERS[index] = fresh
    return buf


def _combine(part_o, part_lse, sink, out, lse, splits: int, merge: MergePlan) -> None:
    """The splits' merge kernel, as the plan chose it (`plan._merge_plan`)."""
    kernel = _kernels._combine_kernel if merge.oneshot else _kernels._combine_stream_kernel
    fast_launch(kernel, merge.grid, (part_o, part_lse, sink if sink is not None else lse,
                                     out, out.stride(0), out.stride(1), lse, lse.stride(0), splits),
                merge.kwargs, max_shared=merge.max_shared)


def sparse_mla_decode_triton(q, kv, window_idx, extra_kv=None, extra_idx=None, sink=None, scale=None,
                             window_lens=None, extra_lens=None, *, config: LaunchConfig | None = None):
    """Triton sparse MLA decode on bf16/fp16/fp32 rows; arguments and outputs as `sparse_mla_decode_ref`.

    Constraints: D = 512, H in {16, 32, 64}, kv/extra_kv in q's dtype with a contiguous last dim.
    Index values are not checked (no host sync): each must be -1 or a row of its cache.
    fp32 runs (exact-precision dots) but is the slow path; bf16 is the fast one.
    """
    checks.check_extra_pair(extra_kv, extra_idx)
    b, h, w, k = _check_common(q, window_idx, extra_idx, sink, window_lens, extra_lens, extra_kv is not None)
    for name, rows in (("kv", kv), ("extra_kv", extra_kv)):
        if rows is None:
            continue
        checks.check_rows(rows, DIM, name, q.device)
        if rows.dtype != q.dtype or rows.stride(1) != 1:
            raise checks.SparseDecodeInputError(
                f"{name} must have q's dtype ({q.dtype}) and a contiguous last dim, got {rows.dtype} stride {rows.stride()}"
            )
    return _launch(q, kv, kv.stride(0), extra_kv, extra_kv.stride(0) if extra_kv is not None else 0,
                   window_idx, extra_idx, sink, scale, window_lens, extra_lens, w, k, False, config)


def sparse_mla_decode_fp8_triton(q, kv_cache, window_idx, extra_cache=None, extra_idx=None, sink=None,
                                 scale=None, window_lens=None, extra_lens=None, *, config: LaunchConfig | None = None):
    """Triton sparse MLA decode on the V4 fp8 layout (uint8 [pages, 37440] caches, slot indices).

    Arguments and outputs as `sparse_mla_decode_fp8_ref`; q is bf16/fp16 [B, H, 512], H in {16, 32, 64}.
    """
    checks.check_extra_pair(extra_cache, extra_idx)
    b, h, w, k = _check_common(q, window_idx, extra_idx, sink, window_lens, extra_lens, extra_cache is not None)
    check_cache(kv_cache, "kv_cache")
    if extra_cache is not None:
        check_cache(extra_cache, "extra_cache")
    for name, cache in (("kv_cache", kv_cache), ("extra_cache", extra_cache)):
        if cache is not None and cache.device != q.device:
            raise checks.SparseDecodeInputError(f"{name} is on {cache.device} but q is on {q.device}")
    return _launch(q, kv_cache, DEFAULT_GEOMETRY.page_stride, extra_cache, DEFAULT_GEOMETRY.page_stride, window_idx,
                   extra_idx, sink, scale, window_lens, extra_lens, w, k, True, config)


def sparse_decode_paged(q, window, extra, sink, scale, out, lse, *, config: LaunchConfig | None = None):
    """Sparse decode on V4 fp8 caches of any page geometry, into given out / lse views (the SGLang adapter).

    q [B, h, 512] bf16 (any batch and head strides), h in {16, 32, 64}; window / extra (extra may be None):
    (cache bytes, PageGeometry, indices int32 [B, n] (contiguous last dim), lens int32 [B] or None), where
    the cache tensor's data pointer is page 0 and page p starts geometry.page_stride bytes later; out
    [B, h, 512] bf16 and lse [B, h] float32 views (unit head stride for lse). Shapes only are checked by
    the caller (flash_mla adapter); index values are not (each is -1 or a slot of its cache).
    """
    cache, w_geo, window_idx, window_lens = window
    e_cache, e_geo, extra_idx, extra_lens = extra if extra is not None else (None, DEFAULT_GEOMETRY, None, None)
    w, k = window_idx.shape[1], 0 if extra_idx is None else extra_idx.shape[1]
    return _launch(q, cache, w_geo.page_stride, e_cache, e_geo.page_stride, window_idx, extra_idx, sink, scale,
                   window_lens, extra_lens, w, k, True, config, (w_geo, e_geo), out, lse)

