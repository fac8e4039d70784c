"""DeepSeek-V4 sparse MLA decode: 64 query heads over one shared 512-dim KV head (V = K).

Shapes and semantics: `reference.sparse_mla_decode_ref` (float rows) and `sparse_mla_decode_fp8_ref` (SGLang's V4
fp8 layout, uint8 [pages, 37440]; see fp8_layout, quantize_kv_v4). The kernels' entry points are in `launch.py`;
the callers choose between kernel and reference (`workers/engine/kernel_ops.py`, `sglang_adapters/flash_mla.py`).
"""

from __future__ import annotations

from .checks import SparseDecodeInputError
from .fp8_layout import dequantize_kv_v4, quantize_kv_v4
from .reference import sparse_mla_decode_fp8_ref, sparse_mla_decode_ref

__all__ = [
    "SparseDecodeInputError",
    "dequantize_kv_v4",
    "quantize_kv_v4",
    "sparse_mla_decode_fp8_ref",
    "sparse_mla_decode_ref",
]
