"""The fp8 indexer-key page layout (132 B per entry at Di = 128), and the quantiser that writes it.

Why a layout of our own making: it is the one DeepGEMM's `fp8_paged_mqa_logits` and SGLang's
indexer cache use, so pages can be handed between them unchanged. One page of E entries is
E*Di e4m3 bytes (row t at byte t*Di) followed by E float32 scales (entry t at byte E*Di + 4t);
key[t] = float(e4m3[t]) * scale[t]. As a tensor: uint8 [P, E*(Di+4)].
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def quantize_keys(keys: torch.Tensor) -> torch.Tensor:
    """Quantise float keys [P, E, Di] to the fp8 page layout uint8 [P, E*(Di+4)].

    One scale per entry: amax(|k_t|) / 448 (1.0 for an all-zero row), so every scale is > 0.
    """
    if keys.dim() != 3 or not keys.is_floating_point():
        raise ValueError(f"keys must be a float tensor [P, E, Di]; got {tuple(keys.shape)} {keys.dtype}")
    pages, per_page, dim = keys.shape
    k = keys.float()
    amax = k.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # [P, E]
    values = (k / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(pages, per_page * dim)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(pages, per_page * 4)
    return torch.cat([values, scale_bytes], dim=1).contiguous()


def dequantize_keys(k_cache_fp8: torch.Tensor, dim: int) -> torch.Tensor:
    """Float32 keys [P, E, Di] from the fp8 page layout uint8 [P, E*(Di+4)]."""
    pages, page_bytes = k_cache_fp8.shape
    per_page = page_bytes // (dim + 4)
    raw = k_cache_fp8.contiguous()
    values = raw[:, : per_page * dim].view(torch.float8_e4m3fn).float().reshape(pages, per_page, dim)
    scale = raw[:, per_page * dim :].contiguous().view(torch.float32).reshape(pages, per_page)
    return values * scale[..., None]
