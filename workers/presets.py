"""Model presets of the embedded engine: the shapes of its seeded random-weight model.

- `tiny` (the default, `examples/local.yaml`): small enough for a 2-core CPU; 8 heads x 64 dims.
- `flash`: DeepSeek-V4-Flash's attention shapes, what our kernels and SGLang's V4 kernels take: 64 query heads
  of head dim 512 (448 + 64 RoPE), one shared KV head (V = K), a window of 128 tokens, the top-512 over ratio-4
  compressed entries, an indexer of 64 heads x 128 dims; 4 layers with a small MLP (d_model 1024, FFN 2048).
  In bf16 its weights take about 0.7 GB and its KV 5.4 KB per token over the 4 layers (a main row of
  512 values per token, a compressed row and an index key per 4 tokens), so one H200 holds the weights and a
  pool of a few million tokens: 1M-token configured contexts fit with room for a batch of them.
  Not modelled: the ratio-128 layers, the fp8 (584-byte) KV layout, MoE.
"""

from __future__ import annotations

from dataclasses import replace

from .model import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "flash": ModelConfig(d_model=1024, n_layers=4, n_heads=64, head_dim=512, rope_dim=64, window=128, ratio=4,
                         topk=512, index_heads=64, index_dim=128, ffn_dim=2048),
}


class PresetError(ValueError):
    """A preset name the engine does not know."""


def model_config(preset: str, seed: int = 0, **overrides: int) -> ModelConfig:
    """The preset's config with `seed` (and any field overridden, e.g. n_layers for a CPU test)."""
    if preset not in PRESETS:
        raise PresetError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
    return replace(PRESETS[preset], seed=seed, **overrides)


def kv_bytes_per_token(cfg: ModelConfig, element_size: int) -> float:
    """KV bytes one token occupies in the pool over all layers (main row + its share of the compressed
    row and of the index key)."""
    per_layer = cfg.head_dim + (cfg.head_dim + cfg.index_dim) / cfg.ratio
    return per_layer * cfg.n_layers * element_size
