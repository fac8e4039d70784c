"""Model runner: extend (prefill) chunks of several prompts, decode a batch, and the single-process reference path.

`generate_single_process` is the correctness oracle of the disaggregated path: for the same prompt
and seed, greedy tokens through prefill -> NIXL -> decode must equal what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_pool import KVPool, PoolLayout
from .model import Batch, ModelConfig, TinyDSV4
from .request import Req
from .sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + len(token_ids)) of one prompt, whose KV goes to `pages`."""

    token_ids: list[int]
    start: int
    pages: list[int]


@dataclass(frozen=True)
class RunnerConfig:
    model: ModelConfig
    page_size: int
    max_total_tokens: int
    context_length: int
    device: str = "cpu"

    def layout(self) -> PoolLayout:
        m = self.model
        return PoolLayout(page_size=self.page_size, num_pages=self.max_total_tokens // self.page_size,
                          n_layers=m.n_layers, head_dim=m.head_dim, index_dim=m.index_dim,
                          ratio=m.ratio, dtype="float32")


class ModelRunner:
    def __init__(self, cfg: RunnerConfig):
        self.cfg = cfg
        self.model = TinyDSV4(cfg.model, device=cfg.device)
        self.pool = KVPool(cfg.layout(), device=cfg.device)
        self.sampler = Sampler(cfg.model.vocab_size)
        self.max_pages = self.pool.pages_for(cfg.context_length)

    def prefill(self, token_ids: list[int], pages: list[int]) -> torch.Tensor:
        """Fill `pages` with the prompt's KV; return the last position's logits [vocab]."""
        return self.extend([Chunk(token_ids, 0, pages)])[0]

    def extend(self, chunks: list[Chunk]) -> torch.Tensor:
        """One forward over prompt chunks of one or more requests (chunked, batched prefill).

        Chunk i holds tokens [start, start + len(token_ids)) of a prompt whose KV lives in `pages`;
        the positions before `start` must have been extended already. Returns logits [len(chunks),
        vocab] at each chunk's last token (the next-token logits once a chunk ends its prompt).
        """
        dev = self.cfg.device
        tokens, positions, tables, segments, ends = [], [], [], [], []
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            tokens.extend(c.token_ids)
            positions.append(torch.arange(c.start, c.start + n, device=dev))
            tables.append(self.pool.page_table(c.pages, self.max_pages)[None, :].expand(n, -1))
            segments.append((row, row + n))
            row += n
            ends.append(row - 1)
        batch = Batch(tokens=torch.tensor(tokens, device=dev), positions=torch.cat(positions),
                      pages=torch.cat(tables), segments=tuple(segments))
        return self.model.forward(batch, self.pool, last_only=torch.tensor(ends, device=dev))

    def decode(self, tokens: list[int], positions: list[int], page_lists: list[list[int]]) -> torch.Tensor:
        """One step for a batch: token b sits at positions[b] of its request -> logits [B, vocab]."""
        dev = self.cfg.device
        batch = Batch(tokens=torch.tensor(tokens, device=dev),
                      positions=torch.tensor(positions, device=dev),
                      pages=torch.stack([self.pool.page_table(p, self.max_pages) for p in page_lists]))
        return self.model.forward(batch, self.pool)


def generate_single_process(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams,
                            eos_token_id: int) -> list[int]:
    """Prefill then decode one request in this process; returns the output token ids."""
    budget = min(len(prompt_ids) + params.max_new_tokens, runner.cfg.context_length)
    req = Req(rid="single-process", prompt_ids=prompt_ids, params=params, budget=budget, emit=lambda e: None)
    pages = runner.pool.alloc(budget)
    try:
        req.out.append(runner.sampler.sample(runner.prefill(prompt_ids, pages), params, 0))
        while req.finished(eos_token_id) is None:
            logits = runner.decode([req.out[-1]], [len(prompt_ids) + len(req.out) - 1], [pages])[0]
            req.out.append(runner.sampler.sample(logits, params, len(req.out)))
        return req.out
    finally:
        runner.pool.release(pages)
