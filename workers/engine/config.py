"""The embedded engine's model shapes (`ModelConfig`, the presets' type): no torch, so a topology check reads a preset
without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tokenizer import VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 8
    head_dim: int = 64
    rope_dim: int = 16
    window: int = 16
    ratio: int = 4
    topk: int = 8
    index_heads: int = 4
    index_dim: int = 32
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    seed: int = 0
    # each layer's compression ratio, repeated over the layers when shorter (() = every layer `ratio`): `ratio`
    # (indexer + top-k) or DENSE_RATIO (every entry attended)
    compress_ratios: tuple[int, ...] = ()

    def __post_init__(self):
        bad = sorted(set(self.compress_ratios) - {self.ratio, DENSE_RATIO})
        if bad:
            raise ValueError(f"compress_ratios {bad}: a layer's ratio is {self.ratio} (indexed) or {DENSE_RATIO}")

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        cycle = self.compress_ratios or (self.ratio,)
        return tuple(cycle[i % len(cycle)] for i in range(self.n_layers))


DENSE_RATIO = 128  # DeepSeek-V4's ratio-128 layers: every complete entry attended, no indexer
