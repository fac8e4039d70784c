"""`flash_mla_with_kvcache` with the signature of SGLang 0.5.23's wrapper, on our sparse-decode kernels.

What SGLang passes (`DeepseekV4AttnBackend._forward_attention`, decode of a V4 model): q [B, 1, 64, 512]
bf16 (at TP4 only the first 16 heads are real, the rest padding); the window cache as a byte view
[pages, 256, 1, 584] whose stride(0) is the page stride (149,760 B) with indices [B, 1, W] and topk_length
[B]; on compressed layers an extra cache ([pages, 64, 1, 584] at ratio 4, [pages, 2, 1, 584] at ratio 128)
with extra_indices_in_kvcache [B, 1, K] and extra_topk_length [B]; attn_sink [64] float32;
is_fp8_kvcache=True; use_legacy=True. Indices are slots (page * page_tokens + offset), -1 = none.

Only that call is computed: anything else (s_q > 1, dense decode, another cache format) raises
`AdapterCallError` naming the argument. `real_heads` (keyword, not in SGLang's signature) computes only
the first h heads and leaves the rest of the output unwritten, as the model slices them off anyway.

Eager cost (`launch_cache`): per call, the shape-class key of every tensor argument (shape, strides, dtype,
device), the scalars and the stream, 16-byte alignment, not capturing, no launch hook; then the recorded
launches. Per key (its first call): every check below, the backend and split choice, the launch plan.
block_table, cache_seqlens and tile_scheduler_metadata are ignored, so they are in no key.
"""

from __future__ import annotations

import functools

import torch

from ..launch_cache import LaunchCache, signature
from ..sparse_mla_decode import fp8_layout
from ..sparse_mla_decode.fp8_layout import PageGeometry
from ..sparse_mla_decode.reference import sparse_mla_decode_paged_ref
from .errors import AdapterCallError, fail

DIM = fp8_layout.DIM
CACHE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)
KERNEL_HEADS = (16, 32, 64)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    kv_format: str | None = None,
    *,
    use_legacy: bool = True,
    real_heads: int | None = None,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 sparse decode. Returns (out [B, 1, H, 512] bf16, softmax_lse [B, H, 1] float32), as FlashMLA.

    out = softmax(scale * q k^T) v over the valid window and extra rows of each query (a row is valid when
    its index is not -1 and its position is below topk_length / extra_topk_length), times
    exp(lse) / (exp(lse) + exp(attn_sink[h])). block_table, cache_seqlens and tile_scheduler_metadata are
    ignored (FlashMLA's sparse decode ignores the first two; the third is its own schedule). A query with
    no valid row gets out 0 and lse -inf. Heads at and past `real_heads` are not written, except where
    the config names the wgmma Gluon kernel, which computes the padded heads too (`heads_to_run`).
    config: a `launch.LaunchConfig` (backend, splits; benchmarks and tests), None = the default.
    """
    tensors = (q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices_in_kvcache,
               extra_topk_length)
    key, ptrs = signature(tensors, (head_dim_v, softmax_scale, causal, is_fp8_kvcache, kv_format, use_legacy,
                                    real_heads, config, num_splits is None and descale_q is None and descale_k is None))
    plan = _PLANS.hit(key, ptrs)
    if plan is not None:
        out = q.new_empty(plan.extra["out"], dtype=torch.bfloat16)
        lse = q.new_empty(plan.extra["lse"], dtype=torch.float32)
        if plan.steps is None:
            _compute(q, tensors, plan.extra["call"], plan.extra["h"], softmax_scale, out, lse, config)
        else:
            ptrs.append(out.data_ptr())
            ptrs.append(lse.data_ptr())
            plan.replay(ptrs, tensors + (out, lse))
        return out, lse
    call = _check(q, k_cache, head_dim_v, num_splits, causal, descale_q, descale_k, is_fp8_kvcache, indices,
                  attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length, kv_format,
                  use_legacy, real_heads)
    b, _, heads, _ = q.shape
    h = heads_to_run(q, call["h"], config)
    out = torch.empty(b, 1, heads, DIM, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, heads, 1, dtype=torch.float32, device=q.device)
    extra = dict(call=call, h=h, out=tuple(out.shape), lse=tuple(lse.shape))
    with _PLANS.recording(key, ptrs + [out.data_ptr(), lse.data_ptr()], tensors + (out, lse), extra, q.is_cuda):
        _compute(q, tensors, call, h, softmax_scale, out, lse, config)
    return out, lse


# One launch plan per shape class of SGLang's call (`launch_cache`): checks once per key, then the launches.
_PLANS = LaunchCache("flash_mla_with_kvcache")


def _compute(q, tensors, call, h, softmax_scale, out, lse, config) -> None:
    """The checked call's computation into out / lse: our kernels on CUDA, the reference on CPU."""
    _, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length = tensors
    scale = DIM**-0.5 if softmax_scale is None else float(softmax_scale)
    sink = attn_sink[:h] if attn_sink is not None else None
    window = (k_cache.view(torch.uint8), call["window_geo"], indices[:, 0], topk_length)
    extra = None
    if extra_k_cache is not None:
        extra = (extra_k_cache.view(torch.uint8), call["extra_geo"], extra_indices[:, 0], extra_topk_length)
    if q.is_cuda:
        from ..sparse_mla_decode.launch import sparse_decode_paged

        sparse_decode_paged(q[:, 0, :h], window, extra, sink, scale, out[:, 0, :h], lse[:, :h, 0], config=config)
    else:
        o, l = reference_decode(q[:, 0, :h], window, extra, sink, scale)
        out[:, 0, :h] = o
        lse[:, :h, 0] = l


def heads_to_run(q: torch.Tensor, h: int, config) -> int:
    """Heads to compute for `h` real ones: h, except where the config names the wgmma Gluon kernel ("gluon"),
    which takes all of q's (64) heads as its M. Whether all 64 heads on that kernel beat h heads on the table's
    h-head row is the route table's question (`decode_routes`, "ours_all_heads"), answered from measurements."""
    if h == q.shape[2] or not q.is_cuda or config is None or config.backend != "gluon":
        return h
    return q.shape[2]


def reference_decode(q3: torch.Tensor, window: tuple, extra: tuple | None, sink, scale: float):
    """The fp32 reference of one call (CPU path and tests): `sparse_mla_decode_paged_ref` on the caches' pages.

    window / extra: (cache bytes [pages, T, 1, 584] uint8, PageGeometry, indices [B, n], lens [B] or None).
    Returns (out [B, h, 512] in q3's dtype, lse [B, h] float32)."""
    return sparse_mla_decode_paged_ref(q3, _paged(*window), None if extra is None else _paged(*extra), sink, scale)


def _paged(cache: torch.Tensor, geo: PageGeometry, idx: torch.Tensor, lens: torch.Tensor | None) -> tuple:
    """The same arguments with the cache seen as its pages' records and scales, uint8 [pages, T * 584]."""
    pages = cache.reshape(cache.shape[0], -1) if cache.is_contiguous() else torch.as_strided(
        cache, (cache.shape[0], geo.page_tokens * fp8_layout.BYTES_PER_TOKEN), (cache.stride(0), 1))
    return pages, geo, idx, lens


def cache_geometry(cache: torch.Tensor, name: str) -> PageGeometry:
    """The page geometry of a V4 cache view [pages, T, 1, 584] (its page stride is its stride(0), in bytes)."""
    shape, strides = cache.shape, cache.stride()
    if len(shape) != 4:
        fail(f"{name} must be SGLang's view [pages, page_tokens, 1, bytes_per_token]; got shape {list(shape)}")
    if cache.dtype not in CACHE_DTYPES:
        fail(f"{name} must be a byte view (uint8, int8 or float8_e4m3fn); got {cache.dtype}")
    pages, tokens, heads_k, width = shape
    if width != fp8_layout.BYTES_PER_TOKEN:
        fail(f"{name} has {width} bytes per token: only the V4 format (584: 448 e4m3 + 64 bf16 dims + 8 scale "
             "bytes) is supported, not V4.1 (528) or V4.1 fp4 (288)")
    if heads_k != 1:
        fail(f"{name} must have one KV head (MQA); got {heads_k}")
    if strides[1:] != (width, width, 1):
        fail(f"{name} must be a row-major view of its page bytes (strides [page_stride, {width}, {width}, 1]); "
             f"got {strides}")
    return _geometry(name, tokens, strides[0])


@functools.lru_cache(maxsize=64)
def _geometry(name: str, tokens: int, page_stride: int) -> PageGeometry:
    if tokens < 1 or tokens & (tokens - 1):
        fail(f"{name}: page_tokens must be a power of two; got {tokens}")
    if page_stride < tokens * fp8_layout.BYTES_PER_TOKEN:
        fail(f"{name}: the page stride {page_stride} is smaller than a page of {tokens} tokens "
             f"({tokens * fp8_layout.BYTES_PER_TOKEN} B)")
    return PageGeometry(tokens, page_stride)


def _check(q, k_cache, head_dim_v, num_splits, causal, descale_q, descale_k, is_fp8_kvcache, indices, attn_sink,
           extra_k_cache, extra_indices, topk_length, extra_topk_length, kv_format, use_legacy, real_heads) -> dict:
    """Metadata-only checks (no device sync, so graph capture is fine); the call's head count and geometries."""
    if indices is None:
        fail("indices=None asks for dense decode: only the V4 sparse decode is supported")
    if not is_fp8_kvcache:
        fail("is_fp8_kvcache must be True: the V4 sparse decode reads the fp8 cache")
    if causal:
        fail("causal must be False (sparse decode)")
    if not (num_splits is None):
        fail("num_splits must be None (tensor schedules are for dense decode)")
    if not (descale_q is None and descale_k is None):
        fail("descale_q / descale_k are for dense fp8 decode; pass None")
    if not (kv_format in (None, "V4")):
        fail(f"kv_format {kv_format!r} is not supported: only V4 (or None)")
    if not use_legacy:
        fail("use_legacy=False is FlashMLA's interleaved V4.1 path: only the V4 (legacy) layout is supported")
    if head_dim_v != DIM:
        fail(f"head_dim_v must be {DIM}; got {head_dim_v}")
    if q.dim() != 4:
        fail(f"q must be [B, s_q, H, {DIM}]; got shape {list(q.shape)}")
    b, s_q, heads, d = q.shape
    if s_q != 1:
        fail(f"q has s_q = {s_q}: only decode (s_q = 1) is supported (MTP/verify is not)")
    if not (d == DIM and q.dtype == torch.bfloat16):
        fail(f"q must be bf16 with head dim {DIM}; got {q.dtype} {d}")
    if q.stride(3) != 1:
        fail("q's last dim must be contiguous")
    h = heads if real_heads is None else int(real_heads)
    if not (0 < h <= heads):
        fail(f"real_heads must lie in [1, {heads}]; got {real_heads}")
    if q.is_cuda:
        if h not in KERNEL_HEADS:
            fail(f"the kernels compute 16, 32 or 64 heads; got {h} (pad q to one of those)")
    window_geo = cache_geometry(k_cache, "k_cache")
    _check_list(indices, topk_length, b, "indices", "topk_length", q.device)
    extra_geo = None
    if not ((extra_k_cache is None) == (extra_indices is None)):
        fail("extra_k_cache and extra_indices_in_kvcache go together: pass both or neither")
    if extra_k_cache is not None:
        extra_geo = cache_geometry(extra_k_cache, "extra_k_cache")
        _check_list(extra_indices, extra_topk_length, b, "extra_indices_in_kvcache", "extra_topk_length", q.device)
    else:
        if not (extra_topk_length is None):
            fail("extra_topk_length was given without an extra cache")
    if attn_sink is not None:
        if not (attn_sink.shape == (heads,) and attn_sink.dtype == torch.float32):
            fail(f"attn_sink must be float32 [{heads}]; got {attn_sink.dtype} {list(attn_sink.shape)}")
    for name, t in (("k_cache", k_cache), ("extra_k_cache", extra_k_cache), ("attn_sink", attn_sink)):
        if not (t is None or t.device == q.device):
            fail(f"{name} is on {getattr(t, 'device', None)}, q on {q.device}")
    return {"h": h, "window_geo": window_geo, "extra_geo": extra_geo}


def _check_list(idx, lens, b, name, lens_name, device) -> None:
    shape = idx.shape
    if len(shape) != 3 or shape[0] != b or shape[1] != 1:
        fail(f"{name} must be int32 [B={b}, 1, n]; got shape {list(shape)}")
    if idx.dtype != torch.int32 or idx.stride(2) != 1:
        fail(f"{name} must be int32 with a contiguous last dim")
    if idx.device != device:
        fail(f"{name} is on {idx.device}, q on {device}")
    if lens is not None and (lens.shape != (b,) or lens.dtype != torch.int32 or lens.device != device):
        fail(f"{lens_name} must be int32 [B={b}] on q's device; got {lens.dtype} {list(lens.shape)} {lens.device}")


__all__ = ["AdapterCallError", "flash_mla_with_kvcache", "reference_decode", "cache_geometry"]
