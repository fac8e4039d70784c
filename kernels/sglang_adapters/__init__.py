"""Drop-ins for the three calls SGLang 0.5.23 makes in DeepSeek-V4 decode, with exactly their signatures.

    flash_mla_with_kvcache(...)    sparse decode    (SGLang's flash_mla_interface wrapper; + real_heads=)
    flash_mla_with_kvcache_sm120(**kw)  sparse decode on sm_120 (SGLang's flash_mla_sm120 entry)
    fp8_paged_mqa_logits(...)      C4 indexer       (deep_gemm's)
    topk_transform_paged_v2(...)   top-k + pages    (sglang.kernels.ops.attention.dsv4.topk's)

CUDA tensors run our Triton / Gluon kernels; CPU tensors the references. A call outside what SGLang
makes raises `AdapterCallError` naming the argument; nothing silently computes something else.
"""

from .errors import AdapterCallError
from .flash_mla import flash_mla_with_kvcache
from .flash_mla_sm120 import flash_mla_with_kvcache_sm120
from .indexer import fp8_paged_mqa_logits
from .topk import topk_transform_paged_v2

__all__ = ["AdapterCallError", "flash_mla_with_kvcache", "flash_mla_with_kvcache_sm120", "fp8_paged_mqa_logits", "topk_transform_paged_v2"]
