"""The paged KV pool: fixed capacity, page allocator, and the address math the model and NIXL use.

Per layer there are three buffers, all page-major so that one page of a request is one contiguous
byte range per buffer (what NIXL moves): `main` [num_pages * page_size, head_dim] (one row per
token), `comp` [num_pages * entries_per_page, head_dim] (one row per ratio-4 compressed entry), and
`index_keys` [num_pages, entries_per_page, index_dim] (the indexer's keys, paged as the kernel wants).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


class PoolExhausted(RuntimeError):
    """Not enough free pages right now (the caller queues the request and retries)."""


@dataclass(frozen=True)
class PoolLayout:
    """What prefill and decode must agree on before KV pages can move between them."""

    page_size: int
    num_pages: int
    n_layers: int
    head_dim: int
    index_dim: int
    ratio: int
    dtype: str

    @property
    def entries_per_page(self) -> int:
        return self.page_size // self.ratio

    def compatible(self, other: "PoolLayout") -> list[str]:
        """Names of the fields (all but capacity) on which two pools disagree."""
        keys = ("page_size", "n_layers", "head_dim", "index_dim", "ratio", "dtype")
        return [k for k in keys if getattr(self, k) != getattr(other, k)]


class KVPool:
    def __init__(self, layout: PoolLayout, device: str = "cpu", dtype: torch.dtype = torch.float32):
        if layout.page_size % layout.ratio:
            raise ValueError(f"page_size {layout.page_size} must be a multiple of the compression ratio {layout.ratio}")
        self.layout = layout
        n, ps, e = layout.num_pages, layout.page_size, layout.entries_per_page

        def buf(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        self.main = [buf(n * ps, layout.head_dim) for _ in range(layout.n_layers)]
        self.comp = [buf(n * e, layout.head_dim) for _ in range(layout.n_layers)]
        self.index_keys = [buf(n, e, layout.index_dim) for _ in range(layout.n_layers)]
        self._free: deque[int] = deque(range(n))
        self._reserved = 0

    @property
    def capacity_tokens(self) -> int:
        return self.layout.num_pages * self.layout.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes one page occupies across every buffer (what one page's transfer moves)."""
        return sum(b.numel() * b.element_size() for b in self.buffers()) // self.layout.num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_tokens(self) -> int:
        return (self.layout.num_pages - self._reserved - len(self._free)) * self.layout.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.page_size)

    def reserve_pad_page(self) -> int:
        """Take one page out of the allocator for good: padding rows of a CUDA-graph batch write there."""
        self._reserved += 1
        return self._free.pop()

    def alloc(self, num_tokens: int) -> list[int]:
        need = self.pages_for(num_tokens)
        if need > len(self._free):
            raise PoolExhausted(f"{need} pages needed, {len(self._free)} free")
        return [self._free.popleft() for _ in range(need)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, in a fixed order both sides share (the NIXL descriptor order)."""
        return [b for layer in zip(self.main, self.comp, self.index_keys) for b in layer]

    def token_rows(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of `main` for token `positions` ([T] or [T, W]) of requests with page tables `pages` [T, P]."""
        return self._rows(pages, positions, self.layout.page_size)

    def entry_rows(self, pages: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Rows of `comp` (and of `index_keys` flattened) for compressed `entries` ([T] or [T, K])."""
        return self._rows(pages, entries, self.layout.entries_per_page)

    @staticmethod
    def _rows(pages: torch.Tensor, idx: torch.Tensor, per_page: int) -> torch.Tensor:
        idx = idx.long()
        squeeze = idx.dim() == 1
        if squeeze:
            idx = idx[:, None]
        page = torch.gather(pages, 1, idx // per_page).long()   # gathers int32 tables too, never widens them
        rows = page * per_page + idx % per_page
        return rows[:, 0] if squeeze else rows
