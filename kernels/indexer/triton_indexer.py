"""Triton indexer: scores only the live compressed entries of each request, CUDA-graph safe.

Why a grid that does not grow with the context: SGLang's indexer sized its work by the configured
maximum context, which made decode at 1M context 2.68x slower than at 131K. Here the grid is
(split, B), fixed for a given batch, and program s of request b walks blocks s, s+split, ... of
b's live entries only, reading lens[b] on the device. A CUDA graph captured once replays at any
live lengths, and work, bytes read and bytes written are all O(live length): the page table and
the score buffer past lens[b] are never touched.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dsv4_cluster.kernels.indexer.shapes import IndexerInputError, check_indexer_inputs, check_lens_values


@triton.jit
def load_query(q_ptr, w_ptr, b, stride_qb, stride_qh, stride_wb, heads, dim,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, Q_FP8_DOT: tl.constexpr):
    """Request b's query, transposed to [BLOCK_D, BLOCK_H] (zero-padded), and its head weights. e4m3
    queries stay e4m3 with Q_FP8_DOT (fp8 keys then meet them in an fp8 tensor-core product, no key
    conversion), else they are widened to bf16 (exact; the products stay exact in fp32)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < heads
    q_t = tl.load(q_ptr + b * stride_qb + h[None, :] * stride_qh + d[:, None],
                  mask=hm[None, :] & (d[:, None] < dim), other=0.0)
    w = tl.load(w_ptr + b * stride_wb + h, mask=hm, other=0.0).to(tl.float32)
    if q_t.dtype == tl.float8e4nv and not Q_FP8_DOT:
        q_t = q_t.to(tl.bfloat16)
    return q_t, w


@triton.jit
def score_block(q_t, w, k_ptr, scale_ptr, pt_row_ptr, t, n, stride_kp, stride_ke, stride_sp, dim,
                PER_PAGE: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                MASK_D: tl.constexpr):
    """Scores of entries t (a block of BLOCK_T; those >= n are masked and come out 0).

    Keys are the M side of the product (k [T, Di] @ q^T [Di, H]), so the sum over heads is a
    reduction along rows held by one warp, and fp8 keys can be widened in registers."""
    tm = t < n
    d = tl.arange(0, BLOCK_D)
    page = tl.load(pt_row_ptr + t // PER_PAGE, mask=tm, other=0).to(tl.int64)
    slot = t % PER_PAGE
    row = page * stride_kp + slot * stride_ke
    if MASK_D:
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=tm[:, None] & (d[None, :] < dim), other=0)
    else:  # no mask along Di: key rows load as 16-byte vectors
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=tm[:, None], other=0)
    if FP8:
        k = k.to(tl.float8e4nv, bitcast=True).to(q_t.dtype)
    else:
        k = k.to(q_t.dtype)
    if IEEE:
        logits = tl.dot(k, q_t, input_precision="ieee")
    else:
        logits = tl.dot(k, q_t)
    if FP8:
        logits = logits * tl.load(scale_ptr + page * stride_sp + slot, mask=tm, other=0.0)[:, None]
    return tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)


@triton.jit
def _indexer_kernel(
    q_ptr, w_ptr, k_ptr, scale_ptr, pt_ptr, lens_ptr, out_ptr,
    stride_qb, stride_qh, stride_wb, stride_kp, stride_ke, stride_sp, stride_ptb, stride_ob,
    heads, dim, capacity, split,
    PER_PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, MASK_D: tl.constexpr, Q_FP8_DOT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), capacity)
    q_t, w = load_query(q_ptr, w_ptr, b, stride_qb, stride_qh, stride_wb, heads, dim, BLOCK_H, BLOCK_D, Q_FP8_DOT)
    for start in range(pid * BLOCK_T, n, split * BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        score = score_block(q_t, w, k_ptr, scale_ptr, pt_ptr + b * stride_ptb, t, n, stride_kp, stride_ke,
                            stride_sp, dim, PER_PAGE, BLOCK_D, FP8, IEEE, MASK_D)
        tl.store(out_ptr + b * stride_ob + t, score, mask=t < n)


def default_split(batch: int, device: torch.device) -> int:
    """Programs per request: one wave, two programs per multiprocessor (each stages ~80 KB of keys
    in shared memory); measured on the H200 at B = 32, one wave beat 2-4 waves by 15-25%."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, 2 * sms // max(batch, 1))


def indexer_triton(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                   lens: torch.Tensor, **options: Any) -> torch.Tensor:
    """Indexer scores with Triton; same inputs and formula as `reference.indexer_ref`.

    Shapes: q [B, Hi, Di] (bf16, fp16 or fp32, last dim contiguous); weights [B, Hi] float;
    k_cache [P, E, Di] of q's dtype with each key row contiguous; page_table [B, max_pages] int32
    or int64; lens [B] int32/int64 (device). Hi and Di up to 256 (padded to >= 16 inside).
    Returns float32 [B, max_pages*E] (`out` if given, which must be that shape, float32, row
    contiguous). Only scores[b, :lens[b]] are written; the tail is left as it was (uninitialised
    unless `out` was filled by the caller), because writing it would cost O(max context).
    fp32 inputs use IEEE fp32 dot products; bf16/fp16 accumulate in fp32.
    Under CUDA-graph capture, lens values are not checked (that would sync); the kernel clamps
    them to [0, max_pages*E].
    options (keyword only; defaults in `_launch`): out; split, programs per request (None: `default_split`);
    block_t, keys per program step (128); num_warps (4); num_stages (3).
    """
    per_page = check_indexer_inputs(q, weights, k_cache, page_table, lens, key_kind="float")
    if k_cache.dtype != q.dtype:
        raise IndexerInputError(f"k_cache dtype {k_cache.dtype} must equal q's {q.dtype}; cast one of them")
    return _launch(q, weights, k_cache, None, page_table, lens, per_page, **options, stride_kp=k_cache.stride(0),
                   stride_ke=k_cache.stride(1), stride_sp=0, kdim_stride=k_cache.stride(2))


def indexer_fp8_triton(q: torch.Tensor, weights: torch.Tensor, k_cache_fp8: torch.Tensor, page_table: torch.Tensor,
                       lens: torch.Tensor, **options: Any) -> torch.Tensor:
    """`indexer_triton` on fp8 keys: k_cache_fp8 uint8 [P, E*(Di+4)] (each page's bytes contiguous, pages
    stride(0) bytes apart, a multiple of 16: the KV pool's page-major region), layout of `fp8_keys`
    (Di % 4 == 0). Keys are widened to q's dtype (exact for e4m3 into bf16) and each entry's dot
    products scaled by its fp32 scale before the relu. Other shapes and the options (out, split, block_t,
    num_warps, num_stages) as `indexer_triton`.
    """
    per_page = check_indexer_inputs(q, weights, k_cache_fp8, page_table, lens, key_kind="fp8")
    dim = q.shape[-1]
    if dim % 4 or not fp8_pages_ok(k_cache_fp8):
        raise IndexerInputError(f"fp8 keys need Di % 4 == 0 (got {dim}) and k_cache_fp8 pages of contiguous bytes "
                                f"16-B apart (got strides {k_cache_fp8.stride()})")
    scales = k_cache_fp8.view(torch.float32)  # same bytes, one page = E*(Di+4)/4 floats
    scale_base = scales[:, per_page * dim // 4 :]
    return _launch(q, weights, k_cache_fp8, scale_base, page_table, lens, per_page, **options,
                   stride_kp=k_cache_fp8.stride(0), stride_ke=dim, stride_sp=scales.stride(0), kdim_stride=1)


def _launch(q, weights, keys, scales, page_table, lens, per_page, *, stride_kp, stride_ke, stride_sp, kdim_stride,
            out=None, split=None, block_t=128, num_warps=4, num_stages=3):
    batch, heads, dim = q.shape
    if heads > 256 or dim > 256:
        raise IndexerInputError(f"indexer_triton supports Hi, Di <= 256; got Hi={heads}, Di={dim}")
    if q.stride(2) != 1 or kdim_stride != 1 or weights.stride(1) != 1:
        raise IndexerInputError("q, weights and k_cache must be contiguous along their last dim; call .contiguous()")
    capacity = page_table.shape[1] * per_page
    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_lens_values(lens, page_table, per_page, keys.shape[0])
    if out is None:
        out = torch.empty((batch, capacity), dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != (batch, capacity) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise IndexerInputError(f"out must be float32 [B, max_pages*E] = [{batch}, {capacity}] with unit column stride")
    if split is None:
        split = default_split(batch, q.device)
    if batch == 0:
        return out
    grid = (split, batch)
    block_d = max(16, triton.next_power_of_2(dim))
    _indexer_kernel[grid](
        q, weights, keys, scales if scales is not None else keys, page_table, lens, out,
        q.stride(0), q.stride(1), weights.stride(0), stride_kp, stride_ke, stride_sp, page_table.stride(0), out.stride(0),
        heads, dim, capacity, split,
        PER_PAGE=per_page, BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=block_d,
        BLOCK_T=block_t, FP8=scales is not None, IEEE=q.dtype == torch.float32, MASK_D=block_d != dim,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def fp8_pages_ok(k_cache_fp8: torch.Tensor) -> bool:
    """Each page's bytes contiguous and pages a multiple of 16 B apart (so the float32 scale view and vector
    loads line up): a contiguous buffer, or one buffer of the KV pool's page-major region."""
    return k_cache_fp8.dim() == 2 and k_cache_fp8.stride(1) == 1 and k_cache_fp8.stride(0) % 16 == 0
