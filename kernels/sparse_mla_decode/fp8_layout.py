"""SGLang's DeepSeek-V4 fp8 KV-cache layout (584 B/token), its quantiser and its dequantiser.

The fp8 kernel reads this layout directly, so it is written down once here. Per 64-token page:

    64 x 576 B   [448 e4m3 no-RoPE dims | 64 bf16 RoPE dims]   one 576-B record per token
    64 x   8 B   [7 ue8m0 scales, one per 64 no-RoPE dims | 1 pad byte]
    padding      so the page stride is a multiple of 576 B: 37,440 B

A token's slot index is `page * 64 + offset`, the same numbering FlashMLA's V4 sparse decode uses.
ue8m0 byte `e` means the scale 2**(e - 127); the no-RoPE value is e4m3 * scale. Scales are the
power of two at or above amax/448 of each 64-dim tile (amax floored at 1e-4), as FlashMLA's tests
quantise, so dequantising is exact in bf16.
"""

from __future__ import annotations

import torch

from .checks import SparseDecodeInputError

PAGE_TOKENS = 64
DIM = 512
NOPE_DIMS = 448
ROPE_DIMS = 64
TILE = 64
NUM_TILES = NOPE_DIMS // TILE  # 7
RECORD_BYTES = NOPE_DIMS + 2 * ROPE_DIMS  # 576
SCALE_BYTES = NUM_TILES + 1  # 8
BYTES_PER_TOKEN = RECORD_BYTES + SCALE_BYTES  # 584
SCALES_OFFSET = PAGE_TOKENS * RECORD_BYTES  # 36,864
PAGE_STRIDE = -(-PAGE_TOKENS * BYTES_PER_TOKEN // RECORD_BYTES) * RECORD_BYTES  # 37,440
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def num_pages_for(num_tokens: int) -> int:
    return -(-num_tokens // PAGE_TOKENS)


def quantize_kv_v4(kv: torch.Tensor) -> torch.Tensor:
    """Quantise KV rows into the paged V4 fp8 layout.

    kv: [N, 512] float (bf16, fp16 or fp32); row n goes to slot n (page n // 64, offset n % 64).
    Returns: uint8 [ceil(N / 64), 37440]; slots past N in the last page hold zeros.
    """
    if kv.dim() != 2 or kv.shape[1] != DIM:
        raise SparseDecodeInputError(f"quantize_kv_v4: kv must be [N, {DIM}], got {list(kv.shape)}")
    if not kv.is_floating_point():
        raise SparseDecodeInputError(f"quantize_kv_v4: kv must be a float tensor, got {kv.dtype}")
    n = kv.shape[0]
    pages = num_pages_for(n)
    x = torch.zeros(pages * PAGE_TOKENS, DIM, dtype=torch.float32, device=kv.device)
    x[:n] = kv.float()
    nope = x[:, :NOPE_DIMS].view(-1, NUM_TILES, TILE)
    amax = nope.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX))  # [T, 7]
    scale = torch.exp2(exponent)
    q8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, NOPE_DIMS)
    rope = x[:, NOPE_DIMS:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [T, 128]

    cache = torch.zeros(pages, PAGE_STRIDE, dtype=torch.uint8, device=kv.device)
    records = cache[:, :SCALES_OFFSET].view(pages, PAGE_TOKENS, RECORD_BYTES)
    records[..., :NOPE_DIMS] = q8.view(pages, PAGE_TOKENS, NOPE_DIMS)
    records[..., NOPE_DIMS:] = rope.view(pages, PAGE_TOKENS, 2 * ROPE_DIMS)
    scales = cache[:, SCALES_OFFSET:SCALES_OFFSET + PAGE_TOKENS * SCALE_BYTES].view(pages, PAGE_TOKENS, SCALE_BYTES)
    scales[..., :NUM_TILES] = (exponent + 127).to(torch.uint8).view(pages, PAGE_TOKENS, NUM_TILES)
    return cache


def check_cache(cache: torch.Tensor, name: str) -> None:
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != PAGE_STRIDE:
        raise SparseDecodeInputError(
            f"{name} must be the V4 fp8 cache, uint8 [num_pages, {PAGE_STRIDE}] (see quantize_kv_v4), "
            f"got {cache.dtype} {list(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise SparseDecodeInputError(f"{name} must be contiguous; call .contiguous() on it")


def dequantize_kv_v4(cache: torch.Tensor) -> torch.Tensor:
    """The exact bf16 rows of a V4 fp8 cache: uint8 [P, 37440] -> bf16 [P * 64, 512] (slot order)."""
    check_cache(cache, "cache")
    pages = cache.shape[0]
    records = cache[:, :SCALES_OFFSET].reshape(pages * PAGE_TOKENS, RECORD_BYTES)
    scale_bytes = cache[:, SCALES_OFFSET:SCALES_OFFSET + PAGE_TOKENS * SCALE_BYTES]
    exponent = scale_bytes.reshape(pages * PAGE_TOKENS, SCALE_BYTES)[:, :NUM_TILES].float() - 127.0
    nope = records[:, :NOPE_DIMS].contiguous().view(torch.float8_e4m3fn).float()
    nope = nope.view(-1, NUM_TILES, TILE) * torch.exp2(exponent)[..., None]
    rope = records[:, NOPE_DIMS:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.view(-1, NOPE_DIMS), rope], dim=1).to(torch.bfloat16)


def flashmla_view(cache: torch.Tensor) -> torch.Tensor:
    """The same bytes as FlashMLA's V4 k_cache argument: float8_e4m3fn [P, 64, 1, 584], page stride 37440."""
    check_cache(cache, "cache")
    used = cache[:, : PAGE_TOKENS * BYTES_PER_TOKEN].view(torch.float8_e4m3fn)
    return used.view(cache.shape[0], PAGE_TOKENS, 1, BYTES_PER_TOKEN)
