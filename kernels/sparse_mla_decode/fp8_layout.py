"""SGLang's DeepSeek-V4 fp8 KV-cache layout (584 B/token), its quantiser and its dequantiser.

The fp8 kernel reads this layout directly, so it is written down once here. Per page of T tokens:

    T x 576 B    [448 e4m3 no-RoPE dims | 64 bf16 RoPE dims]   one 576-B record per token
    T x   8 B    [7 ue8m0 scales, one per 64 no-RoPE dims | 1 pad byte]
    padding      so the page stride is a multiple of 576 B

SGLang 0.5.23 uses three page sizes (`PageGeometry`): the sliding-window cache 256 tokens (stride
149,760 B), the ratio-4 compressed cache 64 (37,440 B, the default here), the ratio-128 cache 2
(1,728 B). A token's slot index is `page * T + offset`, the numbering FlashMLA's V4 sparse decode uses.
ue8m0 byte `e` means the scale 2**(e - 127); the no-RoPE value is e4m3 * scale. Scales are the
power of two at or above amax/448 of each 64-dim tile (amax floored at 1e-4), as FlashMLA's tests
quantise, so dequantising is exact in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fp8_v4_sizes import (BYTES_PER_TOKEN, DIM, NOPE_DIMS, NUM_TILES, PAGE_STRIDE, PAGE_TOKENS,  # noqa: F401
                            RECORD_BYTES, ROPE_DIMS, SCALE_BYTES, SCALES_OFFSET, TILE, page_stride_for)
from .checks import SparseDecodeInputError

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


@dataclass(frozen=True)
class PageGeometry:
    """Where a slot's bytes lie in one V4 fp8 cache: tokens per page (a power of two) and page stride (B)."""

    page_tokens: int = PAGE_TOKENS
    page_stride: int = PAGE_STRIDE

    def __post_init__(self):
        t = self.page_tokens
        if t < 1 or t & (t - 1):
            raise SparseDecodeInputError(f"page_tokens must be a power of two, got {t}")
        if self.page_stride < t * BYTES_PER_TOKEN:
            raise SparseDecodeInputError(
                f"a page of {t} tokens needs at least {t * BYTES_PER_TOKEN} B, got a page stride of {self.page_stride}")

    @property
    def shift(self) -> int:
        """log2(page_tokens): slot >> shift is the page, slot & (page_tokens - 1) the offset."""
        return self.page_tokens.bit_length() - 1

    @property
    def scales_offset(self) -> int:
        return self.page_tokens * RECORD_BYTES

    @classmethod
    def packed(cls, page_tokens: int) -> "PageGeometry":
        """SGLang's pages of `page_tokens` tokens (`KVLayout.V4.page_bytes`)."""
        return cls(page_tokens, page_stride_for(page_tokens))


DEFAULT_GEOMETRY = PageGeometry()


def num_pages_for(num_tokens: int, page_tokens: int = PAGE_TOKENS) -> int:
    return -(-num_tokens // page_tokens)


def quantize_kv_v4(kv: torch.Tensor, page_tokens: int = PAGE_TOKENS) -> torch.Tensor:
    """Quantise KV rows into the paged V4 fp8 layout.

    kv: [N, 512] float (bf16, fp16 or fp32); row n goes to slot n (page n // T, offset n % T).
    Returns: uint8 [ceil(N / T), page_stride_for(T)] (T = 64: [.., 37440]); slots past N hold zeros.
    """
    if kv.dim() != 2 or kv.shape[1] != DIM:
        raise SparseDecodeInputError(f"quantize_kv_v4: kv must be [N, {DIM}], got {list(kv.shape)}")
    if not kv.is_floating_point():
        raise SparseDecodeInputError(f"quantize_kv_v4: kv must be a float tensor, got {kv.dtype}")
    geo = PageGeometry.packed(page_tokens)
    n = kv.shape[0]
    pages = num_pages_for(n, page_tokens)
    x = torch.zeros(pages * page_tokens, DIM, dtype=torch.float32, device=kv.device)
    x[:n] = kv.float()
    rec, sc = quantize_records(x)

    t = page_tokens
    cache = torch.zeros(pages, geo.page_stride, dtype=torch.uint8, device=kv.device)
    cache[:, :geo.scales_offset].view(pages, t, RECORD_BYTES).copy_(rec.view(pages, t, RECORD_BYTES))
    cache[:, geo.scales_offset:geo.scales_offset + t * SCALE_BYTES].view(pages, t, SCALE_BYTES).copy_(
        sc.view(pages, t, SCALE_BYTES))
    return cache


def quantize_records(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, 512] (float) -> their 576-B records uint8 [N, 576] and 8-B scale rows uint8 [N, 8] (the pad
    byte 0): the bytes `quantize_kv_v4` lays out in pages, for a writer that places rows one by one."""
    x = x.float()
    nope = x[:, :NOPE_DIMS].reshape(-1, NUM_TILES, TILE)
    amax = nope.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX))  # [N, 7]
    scale = torch.exp2(exponent)
    q8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, NOPE_DIMS)
    rope = x[:, NOPE_DIMS:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [N, 128]
    scales = torch.zeros(x.shape[0], SCALE_BYTES, dtype=torch.uint8, device=x.device)
    scales[:, :NUM_TILES] = (exponent + 127).to(torch.uint8)
    return torch.cat([q8, rope], dim=1), scales


def check_cache(cache: torch.Tensor, name: str, geometry: PageGeometry = DEFAULT_GEOMETRY) -> None:
    stride = geometry.page_stride
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != stride:
        raise SparseDecodeInputError(
            f"{name} must be the V4 fp8 cache, uint8 [num_pages, {stride}] (see quantize_kv_v4), "
            f"got {cache.dtype} {list(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise SparseDecodeInputError(f"{name} must be contiguous; call .contiguous() on it")


def decode_records(records: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 512] from n 576-B records and their n 8-B scale rows (both uint8)."""
    exponent = scale_rows[:, :NUM_TILES].float() - 127.0
    nope = records[:, :NOPE_DIMS].contiguous().view(torch.float8_e4m3fn).float()
    nope = nope.view(-1, NUM_TILES, TILE) * torch.exp2(exponent)[..., None]
    rope = records[:, NOPE_DIMS:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.view(-1, NOPE_DIMS), rope], dim=1).to(torch.bfloat16)


def dequantize_kv_v4(cache: torch.Tensor, page_tokens: int = PAGE_TOKENS) -> torch.Tensor:
    """The exact bf16 rows of a V4 fp8 cache: uint8 [P, stride] -> bf16 [P * T, 512] (slot order)."""
    geo = PageGeometry.packed(page_tokens)
    check_cache(cache, "cache", geo)
    pages, t = cache.shape[0], page_tokens
    records = cache[:, :geo.scales_offset].reshape(pages * t, RECORD_BYTES)
    scale_rows = cache[:, geo.scales_offset:geo.scales_offset + t * SCALE_BYTES].reshape(pages * t, SCALE_BYTES)
    return decode_records(records, scale_rows)


def gather_slots(pages: torch.Tensor, geometry: PageGeometry, slots: torch.Tensor) -> torch.Tensor:
    """The exact bf16 rows [*slots.shape, 512] of the given slots (-1 reads as slot 0) of a V4 cache
    seen as uint8 [P, page_stride] pages; only the selected records are read (no whole-cache dequant)."""
    flat = slots.reshape(-1).clamp_min(0).long()
    page, off = flat >> geometry.shift, flat & (geometry.page_tokens - 1)
    rec = (off * RECORD_BYTES)[:, None] + torch.arange(RECORD_BYTES, device=pages.device)
    sc = (geometry.scales_offset + off * SCALE_BYTES)[:, None] + torch.arange(SCALE_BYTES, device=pages.device)
    rows = decode_records(pages[page[:, None], rec], pages[page[:, None], sc])
    return rows.view(*slots.shape, DIM)


def flashmla_view(cache: torch.Tensor, page_tokens: int = PAGE_TOKENS) -> torch.Tensor:
    """The bytes as SGLang hands FlashMLA a V4 k_cache: float8_e4m3fn [P, T, 1, 584], stride(0) = page stride."""
    geo = PageGeometry.packed(page_tokens)
    check_cache(cache, "cache", geo)
    used = cache[:, : page_tokens * BYTES_PER_TOKEN].view(torch.float8_e4m3fn)
    return used.view(cache.shape[0], page_tokens, 1, BYTES_PER_TOKEN)
