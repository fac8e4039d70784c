"""Model runner: extend (prefill) chunks of several prompts, decode a batch, and the single-process reference path.

`generate_single_process` is the correctness oracle of the disaggregated path: for the same prompt
and seed, greedy tokens through prefill -> NIXL -> decode must equal what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.pool import KVPool, PoolLayout
from .decode_graphs import DecodeGraphs, padded_table
from .model import Batch, ModelConfig, TinyDSV4
from .presets import kv_layout_dtype, pool_layout
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
    kernels: tuple[str, ...] = ()      # on CUDA: the ops that run our kernels (the rest: reference ops)
    cuda_graph_max_bs: int = 64        # decode batches up to this size replay CUDA graphs (0: none)
    kv_dtype: str = "auto"             # --kv-cache-dtype: presets.kv_layout_dtype (auto, fp8_e4m3, ...)

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on CUDA (what the kernels take), float32 on the CPU."""
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    def layout(self, pad_pages: int = 0) -> PoolLayout:
        """The pool: max_total_tokens of pages, plus `pad_pages` kept out of the capacity (CUDA-graph padding)."""
        m = self.model
        return pool_layout(m, kv_layout_dtype(self.kv_dtype, m, self.device), self.page_size,
                           self.max_total_tokens // self.page_size + pad_pages)


class ModelRunner:
    """Forward passes over the pool; logits come back on the host (one copy per step)."""

    def __init__(self, cfg: RunnerConfig):
        self.cfg = cfg
        self.use_device()
        self.model = TinyDSV4(cfg.model, device=cfg.device, dtype=cfg.dtype, kernels=cfg.kernels)
        graphs = cfg.device.startswith("cuda") and cfg.cuda_graph_max_bs > 0 and self.model.ops.all_kernels
        # the graphs' padding page comes on top of max_total_tokens, as SGLang's padding slot does
        self.pool = KVPool(cfg.layout(pad_pages=1 if graphs else 0), device=cfg.device, dtype=cfg.dtype)
        self.sampler = Sampler(cfg.model.vocab_size)
        self.max_pages = self.pool.pages_for(cfg.context_length)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.pool, self.max_pages, cfg.cuda_graph_max_bs)
        self.eager_steps = 0

    def use_device(self) -> None:
        """Make the runner's GPU this thread's current CUDA device (Triton launches, graph capture and streams
        follow the current device, not the tensors'); a no-op on the CPU. Every thread that runs the model calls it."""
        dev = torch.device(self.cfg.device)
        if dev.type == "cuda" and dev.index is not None:    # plain "cuda" is the current device already
            torch.cuda.set_device(dev)

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
        tokens, positions, segments, ends = [], [], [], []
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            tokens.extend(c.token_ids)
            positions.append(torch.arange(c.start, c.start + n))
            segments.append((row, row + n))
            row += n
            ends.append(row - 1)
        table = padded_table([c.pages for c in chunks], 0).to(dev)       # one row per chunk, its pages
        rows_of = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([b - a for a, b in segments]))
        batch = Batch(tokens=torch.tensor(tokens, device=dev), positions=torch.cat(positions).to(dev),
                      pages=table[rows_of.to(dev)], segments=tuple(segments))
        return self.model.forward(batch, self.pool, last_only=torch.tensor(ends, device=dev)).cpu()

    def decode(self, tokens: list[int], positions: list[int], page_lists: list[list[int]]) -> torch.Tensor:
        """One step for a batch: token b sits at positions[b] of its request -> logits [B, vocab] (host).

        A CUDA-graph replay when a graph of this size (or larger) was captured, else one eager forward whose
        page tables are as wide as the batch's longest (never the configured context)."""
        if self.graphs is not None and len(tokens) <= self.graphs.max_bs:
            return self.graphs.run(tokens, positions, page_lists).cpu()
        self.eager_steps += 1
        dev = self.cfg.device
        batch = Batch(tokens=torch.tensor(tokens, device=dev), positions=torch.tensor(positions, device=dev),
                      pages=padded_table(page_lists, 0).to(dev))
        return self.model.forward(batch, self.pool).cpu()


def generate_single_process(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams,
                            eos_token_id: int) -> list[int]:
    """Prefill then decode one request in this process; returns the output token ids."""
    budget = min(len(prompt_ids) + params.max_new_tokens, runner.cfg.context_length)
    req = Req(rid="single-process", prompt_ids=prompt_ids, params=params, budget=budget, emit=lambda e: None)
    pages = runner.pool.alloc(budget)
    try:
        req.out.append(runner.sampler.sample(runner.prefill(prompt_ids, pages), params, 0, req.next_ids()))
        while req.finished(eos_token_id) is None:
            logits = runner.decode([req.out[-1]], [len(prompt_ids) + len(req.out) - 1], [pages])[0]
            req.out.append(runner.sampler.sample(logits, params, len(req.out), req.next_ids()))
        return req.out
    finally:
        runner.pool.release(pages)
