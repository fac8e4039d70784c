"""Model presets of the embedded engine: the shapes of its seeded random-weight model, and its KV layout.

- `tiny` (the default): small enough for a 2-core CPU; 8 heads x 64 dims, every layer ratio 4, float32 KV.
- `flash`: DeepSeek-V4-Flash's attention shapes (64 heads of 448 + 64 RoPE dims, one KV head, window 128, top-512
  over ratio-4 entries by a 64 x 128 indexer, ratio-128 layers), 4 layers alternating ratio 4 and 128 as V4-Flash
  does, a small MLP. On CUDA its KV is SGLang's fp8 layout (`kv_bytes_per_token`: 2,712 B per token at 256-token
  pages), so one H200 holds 1M-token contexts. Pages: a multiple of 128 tokens, a power of two for fp8.
"""

from __future__ import annotations

from dataclasses import replace

from ..kv.layout import FP8, PoolLayout
from .config import DENSE_RATIO, ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "flash": ModelConfig(d_model=1024, n_layers=4, n_heads=64, head_dim=512, rope_dim=64, window=128, ratio=4,
                         topk=512, index_heads=64, index_dim=128, ffn_dim=2048, compress_ratios=(4, DENSE_RATIO)),
}
KV_CACHE_DTYPES = ("auto", "float32", "bf16", "bfloat16", FP8)   # --kv-cache-dtype (SGLang's names)


class PresetError(ValueError):
    """A preset name the engine does not know."""


class KVDtypeError(ValueError):
    """A --kv-cache-dtype this model or device cannot keep its KV in."""


def model_config(preset: str, seed: int = 0, **overrides) -> ModelConfig:
    """The preset's config with `seed` (and any field overridden, e.g. n_layers for a CPU test)."""
    if preset not in PRESETS:
        raise PresetError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
    return replace(PRESETS[preset], seed=seed, **overrides)


def fp8_capable(cfg: ModelConfig) -> bool:
    """The model's rows are what SGLang's fp8 V4 layout holds: 512 dims, the last 64 of them RoPE."""
    return cfg.head_dim == 512 and cfg.rope_dim == 64


def kv_layout_dtype(kv_cache_dtype: str, cfg: ModelConfig, device: str) -> str:
    """The pool's `PoolLayout.dtype` for a --kv-cache-dtype: 'auto' is float32 on the CPU; on CUDA the fp8 layout
    for a model of V4's head (flash: what SGLang runs V4 with), else bfloat16."""
    cuda = device.startswith("cuda")
    if kv_cache_dtype == "auto":
        return FP8 if cuda and fp8_capable(cfg) else "bfloat16" if cuda else "float32"
    if kv_cache_dtype == FP8:
        if not fp8_capable(cfg):
            raise KVDtypeError(f"--kv-cache-dtype {FP8}: SGLang's fp8 V4 layout holds 512-dim rows whose last 64 "
                               f"dims are RoPE; this model's are {cfg.head_dim} dims with {cfg.rope_dim} RoPE "
                               "(the tiny preset): use --model-preset flash, or --kv-cache-dtype auto")
        return FP8
    if kv_cache_dtype in ("bf16", "bfloat16"):
        if not cuda:
            raise KVDtypeError(f"--kv-cache-dtype {kv_cache_dtype}: on the CPU the engine keeps float32 rows (or "
                               f"{FP8}); use auto")
        return "bfloat16"
    if kv_cache_dtype == "float32":
        if cuda:
            raise KVDtypeError("--kv-cache-dtype float32: on CUDA the model runs in bf16; use auto, bf16 or "
                               f"{FP8}")
        return "float32"
    raise KVDtypeError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose from {', '.join(KV_CACHE_DTYPES)}")


def pool_layout(cfg: ModelConfig, layout_dtype: str, page_size: int, num_pages: int) -> PoolLayout:
    return PoolLayout(page_size=page_size, num_pages=num_pages, n_layers=cfg.n_layers, head_dim=cfg.head_dim,
                      index_dim=cfg.index_dim, ratio=cfg.ratio, dtype=layout_dtype, layer_ratios=cfg.layer_ratios)


def kv_bytes_per_token(cfg: ModelConfig, layout_dtype: str, page_size: int) -> float:
    """KV bytes one token of capacity occupies in the pool over all layers: a page's bytes over every buffer
    (main rows, compressed rows at each layer's ratio, index keys of the ratio-4 layers; fp8 pages with their
    padding) over its tokens. `layout_dtype` as `kv_layout_dtype` returns it."""
    return pool_layout(cfg, layout_dtype, page_size, 1).page_bytes / page_size
