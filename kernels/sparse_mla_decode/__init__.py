"""DeepSeek-V4 sparse MLA decode: 64 query heads over one shared 512-dim KV head (V = K).

Entry points pick the Triton kernel for CUDA tensors and the PyTorch reference otherwise:

    sparse_mla_decode(q, kv, window_idx, extra_kv=None, extra_idx=None, sink=None, scale=None,
                      window_lens=None, extra_lens=None) -> (out [B, H, D], lse [B, H] float32)
    sparse_mla_decode_fp8(q, kv_cache, window_idx, extra_cache=None, extra_idx=None, ...)
        on SGLang's V4 fp8 layout (uint8 [pages, 37440]; see fp8_layout, quantize_kv_v4).

Shapes and semantics: reference.sparse_mla_decode_ref.
"""

from __future__ import annotations

import torch

from .checks import SparseDecodeInputError
from .fp8_layout import dequantize_kv_v4, quantize_kv_v4
from .reference import sparse_mla_decode_fp8_ref, sparse_mla_decode_ref


def sparse_mla_decode(q: torch.Tensor, kv: torch.Tensor, window_idx: torch.Tensor,
                      extra_kv: torch.Tensor | None = None, extra_idx: torch.Tensor | None = None,
                      sink: torch.Tensor | None = None, scale: float | None = None,
                      window_lens: torch.Tensor | None = None, extra_lens: torch.Tensor | None = None):
    """Triton kernel for CUDA tensors (D = 512, H in {16, 32, 64}), the reference otherwise."""
    if q.is_cuda:
        from .launch import sparse_mla_decode_triton

        return sparse_mla_decode_triton(q, kv, window_idx, extra_kv, extra_idx, sink, scale, window_lens, extra_lens)
    return sparse_mla_decode_ref(q, kv, window_idx, extra_kv, extra_idx, sink, scale, window_lens, extra_lens)


def sparse_mla_decode_fp8(q: torch.Tensor, kv_cache: torch.Tensor, window_idx: torch.Tensor,
                          extra_cache: torch.Tensor | None = None, extra_idx: torch.Tensor | None = None,
                          sink: torch.Tensor | None = None, scale: float | None = None,
                          window_lens: torch.Tensor | None = None, extra_lens: torch.Tensor | None = None):
    """V4 fp8 caches: Triton for CUDA tensors, dequantise + reference otherwise."""
    if q.is_cuda:
        from .launch import sparse_mla_decode_fp8_triton

        return sparse_mla_decode_fp8_triton(q, kv_cache, window_idx, extra_cache, extra_idx, sink, scale,
                                            window_lens, extra_lens)
    return sparse_mla_decode_fp8_ref(q, kv_cache, window_idx, extra_cache, extra_idx, sink=sink, scale=scale,
                                     window_lens=window_lens, extra_lens=extra_lens)


__all__ = [
    "SparseDecodeInputError",
    "dequantize_kv_v4",
    "quantize_kv_v4",
    "sparse_mla_decode",
    "sparse_mla_decode_fp8",
    "sparse_mla_decode_fp8_ref",
    "sparse_mla_decode_ref",
]
