"""Decode steps replayed from CUDA graphs: one graph per captured batch size, a batch padded to the next one.

Captured before the worker says it is ready, largest first, in one memory pool (two eager runs, then the
capture). Inputs are static buffers: tokens [S], positions [S], page tables [S, W] int32, W the pages of a
full-context request. A step copies in its tokens, positions and each row's own pages; stale columns past them
are never read (every op stays within the pages of positions <= the row's own). Padding rows decode token 0 on
the pad page, which the allocator never hands out. Only with every kernel on (the reference ops sync with the
host); batches past the largest size run eagerly.
"""

from __future__ import annotations

import logging

import torch

from ..kv.pool import KVPool
from .model import Batch, TinyDSV4, entry_table

log = logging.getLogger(__name__)
WARMUP_RUNS = 2


def capture_sizes(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to 32, then of 16, and max_bs itself (SGLang's spacing, coarser)."""
    sizes = [s for s in (1, 2, 4, 8, *range(16, 33, 8), *range(48, max_bs + 1, 16)) if s <= max_bs]
    return tuple(sizes if sizes and sizes[-1] == max_bs else [*sizes, max(max_bs, 1)])


class DecodeGraphs:
    def __init__(self, model: TinyDSV4, pool: KVPool, width: int, max_bs: int):
        self.model, self.pool = model, pool
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.pad_page = pool.reserve_pad_page()
        dev = torch.device(model.device)
        self.tokens = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.pages = torch.full((self.max_bs, width), self.pad_page, dtype=torch.int32, device=dev)
        # ratio-128 layers' entry rows, filled per step within each request's own pages (model.Batch.dense_entries)
        dense = [pool.entries_per_page(li) for li, r in enumerate(pool.layout.ratios) if not pool.layout.indexed(li)]
        self.dense_per_page = dense[0] if dense else 0
        self.dense = (torch.zeros(self.max_bs, width * self.dense_per_page, dtype=torch.int32, device=dev)
                      if dense else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0
        self._capture()

    def _forward(self, bs: int) -> torch.Tensor:
        batch = Batch(tokens=self.tokens[:bs], positions=self.positions[:bs], pages=self.pages[:bs],
                      dense_entries=None if self.dense is None else self.dense[:bs])
        return self.model.forward(batch, self.pool)

    def _capture(self) -> None:
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        calls_before = self.model.ops.calls.clone()
        for bs in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=stream, capture_error_mode="thread_local"):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        # warm-up and capture ran the ops on padding only: they are not calls that served a request
        self.model.ops.calls.copy_(calls_before)
        log.info("captured decode CUDA graphs for batch sizes %s", list(self.sizes))

    def size_for(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, tokens: list[int], positions: list[int], page_lists: list[list[int]]) -> torch.Tensor:
        """Logits [len(tokens), vocab] on the device, from the graph of the next captured size."""
        b = len(tokens)
        bs = self.size_for(b)
        if bs is None:
            raise ValueError(f"batch {b} is above the largest captured size {self.max_bs}; run it eagerly")
        width = max(len(p) for p in page_lists)
        self.pages[:b, :width].copy_(padded_table(page_lists, self.pad_page))
        if self.dense is not None:   # entries of the live pages only: O(live), never the configured width
            self.dense[:b, : width * self.dense_per_page].copy_(entry_table(self.pages[:b, :width],
                                                                            self.dense_per_page))
        self.tokens[:b].copy_(torch.tensor(tokens, dtype=torch.int64))
        self.positions[:b].copy_(torch.tensor(positions, dtype=torch.int64))
        if bs > b:
            self.tokens[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.pages[b:bs, 0].fill_(self.pad_page)
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits[bs][:b]


def padded_table(page_lists: list[list[int]], pad: int) -> torch.Tensor:
    """int32 [len(page_lists), longest] on the host: each request's pages, then `pad` (one tensor built once)."""
    width = max(len(p) for p in page_lists)
    return torch.tensor([p + [pad] * (width - len(p)) for p in page_lists], dtype=torch.int32)
