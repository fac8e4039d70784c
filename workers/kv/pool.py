"""The paged KV pool: fixed capacity, page allocator, and the address math the model and NIXL use.

Per layer up to three page-major buffers (one page = one byte range per buffer, what NIXL moves): `main` (a row
per token), `comp` (a row per compressed entry) and, on ratio-4 layers, `index_keys`. Float rows
(`float32`, `bfloat16`), or `fp8_e4m3`, SGLang's DeepSeek-V4 layout (`fp8.py`). A row's index is its slot
(page * rows_per_page + offset), as the kernels number them. Writes quantise on fp8; `read_main` dequantises.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import fp8 as kv_fp8
from .layout import FP8, PoolLayout, PoolLayoutError, keys_page_bytes, rows_page_bytes
from .page_alloc import PageAllocator


class PoolExhausted(RuntimeError):
    """Not enough free pages right now (the caller queues the request and retries)."""


class KVPool:
    def __init__(self, layout: PoolLayout, device: str = "cpu", dtype: torch.dtype = torch.float32):
        problems = layout.problems()
        if problems:
            raise PoolLayoutError("KV pool layout: " + "; ".join(problems))
        self.layout, self.dtype, self.fp8 = layout, dtype, layout.dtype == FP8
        n, ps = layout.num_pages, layout.page_size
        self.main: list[torch.Tensor] = []
        self.comp: list[torch.Tensor] = []
        self.index_keys: list[torch.Tensor | None] = []
        self.region: torch.Tensor | None = None   # fp8: every buffer of a page in one byte range (page_major)
        if self.fp8:
            sizes = []
            for li, r in enumerate(layout.ratios):
                e = ps // r
                sizes += [rows_page_bytes(ps), rows_page_bytes(e)]
                if layout.indexed(li):
                    sizes.append(keys_page_bytes(e, layout.index_dim))
            self.region, views = kv_fp8.page_major(n, sizes, device)
            views.reverse()
        for li, r in enumerate(layout.ratios):
            e = ps // r
            if self.fp8:
                self.main.append(views.pop())
                self.comp.append(views.pop())
                keys = views.pop() if layout.indexed(li) else None
            else:
                self.main.append(torch.zeros(n * ps, layout.head_dim, device=device, dtype=dtype))
                self.comp.append(torch.zeros(n * e, layout.head_dim, device=device, dtype=dtype))
                keys = torch.zeros(n, e, layout.index_dim, device=device, dtype=dtype)
            self.index_keys.append(keys if layout.indexed(li) else None)
        self._free = PageAllocator(n)
        self._reserved = 0
        self.evictable_pages: Callable[[], int] = lambda: 0   # a prefix cache's unlocked pages (prefix_cache.py)

    @property
    def capacity_tokens(self) -> int:
        """Tokens requests can hold (SGLang's `max_total_num_tokens`): every page but the CUDA-graph padding page,
        which SGLang too keeps out of its capacity."""
        return (self.layout.num_pages - self._reserved) * self.layout.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes one page occupies across every buffer, alignment padding included (what one page's transfer
        moves)."""
        return sum(per_page for _, per_page in self.regions())

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def available_tokens(self) -> int:
        """Tokens of free pages (SGLang's `sglang:kv_available_tokens`: its allocator's `available_size()`)."""
        return len(self._free) * self.layout.page_size

    @property
    def evictable_tokens(self) -> int:
        """Tokens of a prefix cache's unlocked pages: KV it keeps that no request holds, freed when a request needs
        the room (SGLang's `sglang:kv_evictable_tokens`: its tree cache's `evictable_size()`)."""
        return self.evictable_pages() * self.layout.page_size

    @property
    def used_tokens(self) -> int:
        """Tokens in use as SGLang counts them (`num_used_tokens` = capacity - (available + evictable)): pages that a
        request (reserved, being computed or decoded) or a KV transfer holds, the cached pages it locked included."""
        return self.capacity_tokens - self.available_tokens - self.evictable_tokens

    @property
    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as runs of consecutive pages, (first page, pages) (what a request's pages come from)."""
        return self._free.runs

    def runs_for(self, num_tokens: int) -> int:
        """How many runs of consecutive pages `alloc(num_tokens)` would hand out now."""
        return self._free.runs_for(self.pages_for(num_tokens))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.page_size)

    def reserve_pad_page(self) -> int:
        """Take one page out of the allocator for good: padding rows of a CUDA-graph batch write there."""
        self._reserved += 1
        return self._free.take_last()

    def alloc(self, num_tokens: int, follow: list[int] | None = None) -> list[int]:
        """Pages for `num_tokens`; `follow`: the peer's pages for the same tokens (`PageAllocator.alloc`)."""
        need = self.pages_for(num_tokens)
        if need > len(self._free):
            raise PoolExhausted(f"{need} pages needed, {len(self._free)} free")
        return self._free.alloc(need, follow)

    def release(self, pages: list[int]) -> None:
        self._free.release(pages)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, in a fixed order both sides share: per layer main, comp, index keys."""
        return [b for layer in zip(self.main, self.comp, self.index_keys) for b in layer if b is not None]

    def regions(self) -> list[tuple[torch.Tensor, int]]:
        """What NIXL registers and moves, (tensor, bytes per page) in an order both sides share: the fp8 pool's
        one page-major region (a run of pages is one byte range for all layers), else every buffer."""
        if self.region is not None:
            return [(self.region, self.region.stride(0))]
        n = self.layout.num_pages
        return [(b, b.numel() * b.element_size() // n) for b in self.buffers()]

    # --- rows: address math -------------------------------------------------------------------------------
    def entries_per_page(self, layer: int) -> int:
        return self.layout.page_size // self.layout.ratios[layer]

    def token_rows(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of `main` for token `positions` ([T] or [T, W]) of requests with page tables `pages` [T, P]."""
        return self._rows(pages, positions, self.layout.page_size)

    def entry_rows(self, pages: torch.Tensor, entries: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Rows of `comp` (and of `index_keys` flattened) for compressed `entries` ([T] or [T, K]) of `layer`
        (None: an indexed, ratio-4 layer)."""
        per_page = self.layout.entries_per_page if layer is None else self.entries_per_page(layer)
        return self._rows(pages, entries, per_page)

    @staticmethod
    def _rows(pages: torch.Tensor, idx: torch.Tensor, per_page: int) -> torch.Tensor:
        idx = idx.long()
        squeeze = idx.dim() == 1
        if squeeze:
            idx = idx[:, None]
        page = torch.gather(pages, 1, idx // per_page).long()   # gathers int32 tables too, never widens them
        rows = page * per_page + idx % per_page
        return rows[:, 0] if squeeze else rows

    # --- rows: values ---------------------------------------------------------------------------------------
    def write_main(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Token rows [N] <- values [N, head_dim]."""
        if self.fp8:
            kv_fp8.write_rows(self.main[layer], self.layout.page_size, rows, values)
        else:
            self.main[layer][rows] = values

    def read_main(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Values [*rows.shape, head_dim] of token rows, in the model's dtype (fp8: dequantised exactly)."""
        if self.fp8:
            return kv_fp8.read_rows(self.main[layer], self.layout.page_size, rows).to(self.dtype)
        return self.main[layer][rows]

    def write_comp(self, layer: int, rows: torch.Tensor, values: torch.Tensor,
                   keep: torch.Tensor | None = None) -> None:
        """Entry rows [N] <- values [N, head_dim]; with `keep` [N] bool, only where it is true (no host sync)."""
        if self.fp8:
            kv_fp8.write_rows(self.comp[layer], self.entries_per_page(layer), rows, values, keep)
        elif keep is None:
            self.comp[layer][rows] = values
        else:
            self.comp[layer][rows] = torch.where(keep[:, None], values, self.comp[layer][rows])

    def write_keys(self, layer: int, rows: torch.Tensor, keys: torch.Tensor,
                   keep: torch.Tensor | None = None) -> None:
        """Index keys of entry rows [N] <- keys [N, index_dim] (an indexed layer's), as `write_comp`."""
        buf = self.index_keys[layer]
        if self.fp8:
            kv_fp8.write_keys(buf, self.layout.index_dim, rows, keys, keep)
            return
        flat = buf.view(-1, self.layout.index_dim)
        flat[rows] = keys if keep is None else torch.where(keep[:, None], keys, flat[rows])
