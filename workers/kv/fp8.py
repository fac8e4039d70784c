"""The KV pool's fp8 buffers: SGLang's DeepSeek-V4 layout (`fp8_layout`, `fp8_keys`), one pool page per buffer page,
so the kernels read the pool as they read SGLang's cache and NIXL moves a page as one byte range. Writers quantise
with the layouts' own quantisers; readers dequantise only the rows they ask for.
"""

from __future__ import annotations

import torch

from ...kernels.indexer.fp8_keys import dequantize_keys, quantize_keys
from ...kernels.sparse_mla_decode.fp8_layout import (DIM, RECORD_BYTES, SCALE_BYTES, PageGeometry, decode_records,
                                                     quantize_records)
from .layout import KEY_SCALE_BYTES

ALIGN = 16          # bytes: every buffer of a page starts on this boundary (vector loads, TMA)


def geometry(buf: torch.Tensor, rows_per_page: int) -> PageGeometry:
    """Where a slot's bytes lie in `buf`, a rows buffer of `rows_per_page` rows per page (its stride(0) is the
    page stride: the pool's region page, see `page_major`)."""
    return PageGeometry(rows_per_page, buf.stride(0))


def page_major(num_pages: int, sizes: list[int], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 region [num_pages, sum(sizes) rounded up to ALIGN] holding every buffer of a page side by side,
    and each buffer as a view uint8 [num_pages, size] of it (stride(0) = the region's page bytes).

    Why: a run of consecutive pages is then one byte range of the region for every layer at once, so NIXL moves
    a request's KV as one descriptor per run instead of one per run and buffer (transfer.py). The kernels read
    a buffer through its page stride (`geometry`), as they read SGLang's caches. Each buffer starts ALIGN-aligned."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    region = torch.zeros(num_pages, total, dtype=torch.uint8, device=device)
    return region, [region[:, o: o + size] for o, size in zip(offsets, sizes)]


def _views(buf: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = buf.shape[0]
    return (buf[:, : t * RECORD_BYTES].view(n, t, RECORD_BYTES),
            buf[:, t * RECORD_BYTES: t * (RECORD_BYTES + SCALE_BYTES)].view(n, t, SCALE_BYTES))


def write_rows(buf: torch.Tensor, rows_per_page: int, rows: torch.Tensor, values: torch.Tensor,
               keep: torch.Tensor | None = None) -> None:
    """Quantise values [N, 512] into slots `rows` [N] (with `keep` [N]: only where true, no host sync)."""
    records, scales = _views(buf, rows_per_page)
    rows = rows.reshape(-1).long()
    page, off = rows // rows_per_page, rows % rows_per_page
    _put(records, scales, page, off, *quantize_records(values.reshape(-1, DIM)), keep)


def read_rows(buf: torch.Tensor, rows_per_page: int, rows: torch.Tensor) -> torch.Tensor:
    """The exact bf16 values [*rows.shape, 512] of slots `rows` (-1 reads as slot 0), as `gather_slots` reads
    them, through [page, row] views (one index per row, not per byte)."""
    records, scales = _views(buf, rows_per_page)
    flat = rows.reshape(-1).clamp_min(0).long()
    page, off = flat // rows_per_page, flat % rows_per_page
    return decode_records(records[page, off], scales[page, off]).view(*rows.shape, DIM)


def write_keys(buf: torch.Tensor, index_dim: int, rows: torch.Tensor, keys: torch.Tensor,
               keep: torch.Tensor | None = None) -> None:
    """Quantise index keys [N, index_dim] into entry rows `rows` [N] (page * entries + offset)."""
    n, entries = buf.shape[0], buf.shape[1] // (index_dim + KEY_SCALE_BYTES)
    values = buf[:, : entries * index_dim].view(n, entries, index_dim)
    scales = buf[:, entries * index_dim:].view(n, entries, KEY_SCALE_BYTES)
    rows = rows.reshape(-1).long()
    page, off = rows // entries, rows % entries
    packed = quantize_keys(keys.reshape(-1, 1, index_dim))           # [N, index_dim + 4]
    _put(values, scales, page, off, packed[:, :index_dim], packed[:, index_dim:], keep)


def _put(values: torch.Tensor, scales: torch.Tensor, page: torch.Tensor, off: torch.Tensor, val: torch.Tensor,
         sc: torch.Tensor, keep: torch.Tensor | None) -> None:
    """Bytes of rows (page, off) of a [pages, rows, bytes] values view and its scales view; with `keep`, the
    old bytes back where it is false (a decode batch's rows that completed no group)."""
    if keep is not None:
        val = torch.where(keep[:, None], val, values[page, off])
        sc = torch.where(keep[:, None], sc, scales[page, off])
    values[page, off] = val
    scales[page, off] = sc


def read_key_pages(buf: torch.Tensor, index_dim: int, pages: torch.Tensor) -> torch.Tensor:
    """Float32 keys [*pages.shape, entries, index_dim] of the given pages (only those are dequantised)."""
    raw = buf[pages.reshape(-1).long()]
    keys = dequantize_keys(raw, index_dim)
    return keys.view(*pages.shape, *keys.shape[1:])
